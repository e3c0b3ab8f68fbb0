"""A `KvHandoff` on stand-ins: an agent that moves no bytes (its reads are recorded in
`agent.reads`) and an engine that records when it is told to reclaim blocks
(`engine.reclaims`, monotonic times)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from kvbaton.engine.engine import KvCacheView
from kvbaton.protocols.llm import KvPoolInfo
from kvbaton.workers.kv_handoff import KvHandoff

POOL = KvPoolInfo(layout="test", num_blocks=8, block_bytes=0, host="")


def make_handoff(timeout_s: float) -> KvHandoff:
    reads: list[tuple[list[int], list[int]]] = []
    agent = SimpleNamespace(
        timeout_s=timeout_s,
        info=lambda: POOL,
        pool=SimpleNamespace(block_bytes=0),
        read=lambda pool, src, dst: reads.append((src, dst)) or "fake",
        reads=reads,
        close=lambda: None,
    )
    reclaims: list[float] = []
    engine = SimpleNamespace(
        release_kv=lambda handle: None,
        reclaim_kv_blocks=lambda: reclaims.append(time.monotonic()),
        reclaims=reclaims,
    )
    runtime = SimpleNamespace(instance_id=7)
    cache = KvCacheView("test", 8, 0, None)
    return KvHandoff(runtime, engine, agent, cache, "ns.backend", 4)  # type: ignore[arg-type]
