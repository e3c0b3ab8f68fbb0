"""Shared helpers of the KV tier tests: a tiny-model engine with tiers, driven synchronously
(each step's tier loads run right after it), and greedy runs of it. The engine runs on
KVBATON_TEST_DEVICE (scripts/cuda_check.sh: cuda, its cache's host mirror pinned)."""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable
from pathlib import Path

from kvbaton.engine import EngineConfig, LLMEngine, SamplingParams
from kvbaton.engine.connector import EngineRequest, KvLoadFailed
from kvbaton.engine.sequence import Sequence
from kvbaton.kv_tiers import KvTiers, TierSettings
from kvbaton.kv_transfer import KvPool
from kvbaton.protocols.kv import KvEvent
from kvbaton.protocols.llm import KvTierStats
from tests.engine.conftest import TEST_DEVICE

BLOCK_SIZE = 8
NEW_TOKENS = 6


def tiered_engine(
    model_dir: Path,
    host_bytes: int = 0,
    disk_dir: Path | None = None,
    disk_bytes: int = 2**30,
    num_kv_blocks: int = 24,
    on_event: Callable[[KvEvent], None] | None = None,
) -> LLMEngine:
    """A float32 engine with a small pool, its cache in a host buffer (a pinned mirror on
    CUDA, unpinned once the engine is gone), and the tiers asked for (none with neither
    `host_bytes` nor `disk_dir`); its KV events go to `on_event`."""
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device=TEST_DEVICE,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks,
    )
    settings = TierSettings(host_bytes, disk_dir, disk_bytes)
    pool = KvPool(shared=False, pin=TEST_DEVICE.startswith("cuda"))
    engine = LLMEngine(
        config,
        on_event,
        cache_buffer=pool.allocate,
        kv_tier=settings.for_model(model_dir) if settings.enabled else None,
    )
    weakref.finalize(engine, pool.close)
    return engine


def greedy(eng: LLMEngine, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """One greedy request to the end; its tier load (if any) runs after the step admitted it."""
    rid = f"r{random.getrandbits(32):08x}"
    eng.add_request(
        EngineRequest(rid, prompt, SamplingParams(max_tokens=new_tokens, temperature=0))
    )
    tokens: list[int] = []
    finished = False
    while not finished:
        for out in eng.step():
            tokens += out.token_ids
            finished = finished or out.finish_reason is not None
        for load in eng.take_kv_loads():
            try:
                eng.finish_kv_load(load.request_id, True, load.source.load(load))
            except KvLoadFailed:
                eng.finish_kv_load(load.request_id, False)
    return tokens


def prompt(seed: int, length: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 96) for _ in range(length)]


def evict_all(eng: LLMEngine, seed: int = 1000) -> None:
    """Run prompts unrelated to any other until every block the pool held was reused."""
    for i in range(3):
        greedy(eng, prompt(seed + i, eng.blocks.num_blocks * eng.config.block_size // 2), 1)


def block_hashes(tokens: list[int]) -> list[int]:
    """The chained hashes of the full blocks of `tokens` (no cache salt)."""
    seq = Sequence("hashes", list(tokens), SamplingParams())
    return seq.full_block_hashes(BLOCK_SIZE, len(tokens) // BLOCK_SIZE)


def tiers_of(eng: LLMEngine) -> KvTiers:
    assert isinstance(eng.tier, KvTiers)
    return eng.tier


def tier_stats(eng: LLMEngine) -> KvTierStats:
    stats = eng.stats().kv_tiers
    assert stats is not None
    return stats
