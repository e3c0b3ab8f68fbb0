"""What the KV-tier tests of a served deployment share: the prompt, its block size, and
whether its blocks are on the disk tier."""

from __future__ import annotations

import random
from pathlib import Path

from kvbaton.llm.hashing import hash_blocks, reusable_blocks

BLOCK_SIZE = 16
PROMPT = [random.Random(0).randrange(10, 300) for _ in range(200)]
CACHED = reusable_blocks(len(PROMPT), BLOCK_SIZE) * BLOCK_SIZE  # its tokens a cache can give


def other_prompts() -> list[list[int]]:
    """Three prompts unrelated to PROMPT, as long: enough to reuse every block of a pool of 32."""
    return [[random.Random(seed).randrange(10, 300) for _ in range(200)] for seed in range(1, 4)]


def offloaded(disk: Path) -> bool:
    """Every reusable block of PROMPT has its file on the disk tier."""
    names = [f"{h:016x}" for h in hash_blocks(PROMPT, BLOCK_SIZE)[: CACHED // BLOCK_SIZE]]
    return all(any(disk.glob(f"*/{name[:2]}/{name}.kvb")) for name in names)
