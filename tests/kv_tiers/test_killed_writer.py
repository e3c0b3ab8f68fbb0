"""`kill -9` of an engine while its disk tier writes: every block file left is whole or
rejected, the dead writer's temporary files are removed, and an engine opened on the directory
afterwards answers as a recompute does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvbaton.kv_tiers import block_file
from tests.helpers import wait_until_sync
from tests.kv_tiers.offload_forever import PROMPT_TOKENS, PROMPTS
from tests.kv_tiers.tier_helpers import greedy, prompt, tier_stats, tiered_engine, tiers_of

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def whole(path: Path) -> bool:
    data = path.read_bytes()
    key = bytes.fromhex(path.parent.parent.name)
    kv_bytes = len(data) - block_file.HEADER_BYTES
    return block_file.decode(data, key, int(path.stem, 16), kv_bytes) is not None


def test_kill_9_while_writing_serves_no_bad_block(tiny_model: Path, tmp_path: Path) -> None:
    victim = subprocess.Popen(
        [sys.executable, "-m", "tests.kv_tiers.offload_forever", str(tiny_model), str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert victim.stdout is not None and victim.stdout.readline() == "serving\n"
        wait_until_sync(
            lambda: len(list(tmp_path.glob("*/*/*.kvb"))) >= 40, 120, "40 blocks offloaded"
        )
        os.kill(victim.pid, signal.SIGKILL)
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait(30)
    files = list(tmp_path.glob("*/*/*.kvb"))
    assert files and all(whole(f) for f in files)
    for tmp in (tmp_path / "tmp").iterdir():  # a write it was in, at most
        assert tmp.name.startswith(f"{victim.pid}-")
    (tmp_path / "tmp" / f"{victim.pid}-999.tmp").write_bytes(files[0].read_bytes()[:-7])

    eng = tiered_engine(tiny_model, disk_dir=tmp_path)
    disk = tiers_of(eng).disk
    assert disk is not None and not list(disk.tmp.iterdir())
    base = tiered_engine(tiny_model)
    for i in range(PROMPTS):
        p = prompt(i, PROMPT_TOKENS)
        assert greedy(eng, p) == greedy(base, p)
    stats = tier_stats(eng)
    assert stats.hit_blocks_disk > 0 and stats.rejected_blocks == 0
