"""A `DecodeSide` or a `PrefillSide` on stand-ins: an agent that moves no bytes (its reads are
recorded in `agent.reads`) and an engine that records the handles it is told to release
(`engine.released`) and when it is told to reclaim blocks (`engine.reclaims`, monotonic times);
or, on a real engine, a prefill worker (`make_prefill_worker`) whose decode workers never answer
a claim, and a hook between a request's move to held and its output's delivery
(`before_held_output`); `counted` shows a side's outcome counts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

from kvbaton.disagg.decode_side import DecodeSide
from kvbaton.disagg.prefill_side import PrefillSide
from kvbaton.engine import AsyncEngine, LLMEngine
from kvbaton.engine.connector import ConnectedEngine, KvCacheView
from kvbaton.engine.engine import StepRun
from kvbaton.protocols.disagg import KvReady
from kvbaton.protocols.llm import EngineOutput, KvPoolInfo, KvTarget
from kvbaton.workers.llm_worker import LLMWorker

POOL = KvPoolInfo(layout="test", num_blocks=8, block_bytes=0, host="")


def _side_args(
    timeout_s: float,
    engine: ConnectedEngine | None = None,
    cache: KvCacheView | None = None,
    block_size: int = 4,
) -> tuple[Any, ...]:
    """On the stand-in engine unless `engine` is given (`cache` then is its view)."""
    reads: list[tuple[list[int], list[int]]] = []
    agent: Any = SimpleNamespace(
        timeout_s=timeout_s,
        info=lambda: POOL,
        pool=SimpleNamespace(block_bytes=0),
        read=lambda pool, src, dst: reads.append((src, dst)) or "fake",
        reads=reads,
        close=lambda: None,
    )
    if engine is None:
        reclaims: list[float] = []
        released: list[str] = []
        engine = SimpleNamespace(
            release_kv=released.append,
            released=released,
            reclaim_kv_blocks=lambda: reclaims.append(time.monotonic()),
            reclaims=reclaims,
        )
    runtime: Any = SimpleNamespace(instance_id=7)
    view = cache or KvCacheView("test", 8, 0, None)
    return (runtime, engine, agent, view, "ns.backend", block_size)


def make_decode_side(
    timeout_s: float,
    engine: ConnectedEngine | None = None,
    cache: KvCacheView | None = None,
    block_size: int = 4,
) -> DecodeSide:
    """A decode (or agg) worker's side, on the stand-ins unless `engine` is given."""
    return DecodeSide(*_side_args(timeout_s, engine, cache, block_size))


def make_prefill_side(
    timeout_s: float,
    engine: ConnectedEngine | None = None,
    cache: KvCacheView | None = None,
    block_size: int = 4,
    **kwargs: Any,
) -> PrefillSide:
    """A prefill worker's side, on the stand-ins unless `engine` is given."""
    return PrefillSide(*_side_args(timeout_s, engine, cache, block_size), **kwargs)


class UnansweringPeers:
    """Decode workers that never answer a claim (it waits until withdrawn); their reports
    (`ready`) are recorded in `reports` as (room, ok)."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, bool]] = []

    async def claim(self, target: KvTarget, timeout_s: float) -> None:
        await asyncio.Event().wait()

    async def ready(self, target: KvTarget, report: KvReady) -> None:
        self.reports.append((target.room, report.ok))

    async def close(self) -> None:
        pass


def make_prefill_worker(
    engine: AsyncEngine, cache: KvCacheView | None = None
) -> tuple[LLMWorker, PrefillSide]:
    """A prefill worker serving "tiny" on `engine` (its KV cache seen as `cache` if given), with
    its side: call it on the test's loop (the side takes it), close the side at the end."""
    view = cache or engine.engine.kv_cache()
    side = make_prefill_side(5.0, engine, view, engine.block_size)
    side.peers = UnansweringPeers()  # type: ignore[assignment]
    runtime: Any = SimpleNamespace(
        instance_id=7, namespace=lambda name: SimpleNamespace(component=lambda name: None)
    )
    worker = LLMWorker(
        runtime,
        engine,
        served_name="tiny",
        namespace="t",
        role="prefill",
        side=side,
    )
    return worker, side


def kv_target(block_size: int, num_blocks: int) -> KvTarget:
    """Decode-first: blocks 0... of a decode worker (`UnansweringPeers`'s) for a prompt."""
    return KvTarget(
        decode_instance_id=1,
        decode_component="ns.decode",
        room="room",
        block_ids=list(range(num_blocks)),
        first_block=0,
        block_size=block_size,
        pool=POOL,
    )


def before_held_output(engine: LLMEngine, act: Callable[[], object]) -> None:
    """Call `act` (where the engine steps) after each step that moved a request to held, before
    `AsyncEngine` delivers that step's outputs (it does once `end_step` returned)."""
    end_step = engine.end_step

    def end_step_then_act(run: StepRun) -> list[EngineOutput]:
        outputs = end_step(run)
        if any(out.kv_blocks is not None for out in outputs):
            act()
        return outputs

    engine.end_step = end_step_then_act  # type: ignore[method-assign]


def counted(counts: Mapping[str, int]) -> dict[str, int]:
    """The outcomes counted at least once (a side's `reads_ended`, `rooms_ended`)."""
    return {how: count for how, count in counts.items() if count}
