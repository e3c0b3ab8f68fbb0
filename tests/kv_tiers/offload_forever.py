"""`python -m tests.kv_tiers.offload_forever MODEL DISK_DIR`: serve prompt after prompt on an
engine with a disk tier whose pool holds about one of them, so that it offloads blocks without
pause, until killed (the kill -9 test's victim)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

from tests.kv_tiers.tier_helpers import greedy, prompt, tiered_engine

PROMPTS = 8  # prompt(0) ... prompt(7), again and again
PROMPT_TOKENS = 96


def main() -> None:
    model, disk = Path(sys.argv[1]), Path(sys.argv[2])
    eng = tiered_engine(model, disk_dir=disk, num_kv_blocks=16)
    for i in itertools.count():
        greedy(eng, prompt(i % PROMPTS, PROMPT_TOKENS), 1)
        if i == 0:
            print("serving", flush=True)


if __name__ == "__main__":
    main()
