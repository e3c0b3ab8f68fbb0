"""A prefill worker's held KV comes back whatever ends its request: cancelled between the
engine's move of the request to held and the worker's read of that output (the engine's stream
for it is gone by then, and no hold timer runs yet), in either transfer order, or while the
blocks are staged out to a mirrored cache (or that copy fails). Its blocks and its
`max_num_seqs` slot are then free, once: a late `kv_release`, or a hold timer, frees nothing
more. On the mocker and on the built-in engine (`serving_engine`). A decode-first push frees
its blocks once its writes stopped, even if cancelled while it waits for that."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from types import SimpleNamespace
from unittest.mock import AsyncMock

import pytest

from kvbaton.disagg.prefill_side import PrefillSide
from kvbaton.engine import AsyncEngine, SamplingParams
from kvbaton.protocols.disagg import KvRelease, KvReleased
from kvbaton.protocols.llm import EngineOutput, PreprocessedRequest
from kvbaton.runtime import Context
from tests.helpers import wait_until
from tests.workers.fakes import before_held_output, kv_target, make_prefill_worker

pytestmark = pytest.mark.unit

PROMPT = list(range(10, 30))  # 20 tokens: 3 blocks of 8
HANDLE = "req#0"  # the worker's engine id for Context("req"), its first request


def prefill_request(engine: AsyncEngine, order: str) -> PreprocessedRequest:
    target = None
    if order == "decode-first":
        target = kv_target(engine.block_size, -(-len(PROMPT) // engine.block_size))
    return PreprocessedRequest(
        model="tiny",
        token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        kv_target=target,
    )


async def assert_all_free(engine: AsyncEngine) -> None:
    """Once the messages sent so far are applied: no request holds a block or a slot."""
    await engine.kv_dump()  # (applied in order: after every message sent before it)
    scheduler = engine.engine.scheduler
    blocks = scheduler.blocks
    taken = (scheduler.num_active, blocks.num_blocks - blocks.num_free_blocks)
    assert taken == (0, 0), f"requests active, blocks taken: {taken} (held: {list(scheduler.held)})"


async def assert_released_once(engine: AsyncEngine, side: PrefillSide) -> None:
    """No hold timer runs for the request; a late release or timer frees nothing more."""
    assert HANDLE not in side._held
    late = await side.kv_release(KvRelease(handle=HANDLE), Context("late"))
    assert late == KvReleased(released=False)
    side._expire(HANDLE)
    engine.release_kv(HANDLE)
    await assert_all_free(engine)


@pytest.mark.parametrize("order", ["prefill-first", "decode-first"])
async def test_a_request_cancelled_before_its_held_output_is_read_frees_its_kv(
    serving_engine: AsyncEngine, order: str
) -> None:
    engine = serving_engine
    worker, side = make_prefill_worker(engine)
    try:
        answer = asyncio.ensure_future(
            anext(worker.generate(prefill_request(engine, order), Context("req")))
        )
        loop = asyncio.get_running_loop()
        # The cancel reaches the loop before the held output does (both in call order).
        before_held_output(engine.engine, lambda: loop.call_soon_threadsafe(answer.cancel))
        with pytest.raises(asyncio.CancelledError):
            await answer
        await assert_all_free(engine)
        await assert_released_once(engine, side)
        if order == "decode-first":  # the decode worker is told that no KV comes
            assert side.peers.reports == [("room", False)]  # type: ignore[attr-defined]
    finally:
        await side.close()


@pytest.mark.parametrize("end", ["cancelled", "copy failed"])
async def test_a_hold_cut_short_while_its_blocks_are_staged_out_frees_them_once_staged(
    serving_engine: AsyncEngine, end: str
) -> None:
    engine = serving_engine
    staging, staged = threading.Event(), threading.Event()

    def stage_out(block_ids: list[int], layers: tuple[int, int] | None = None) -> None:
        staging.set()
        assert staged.wait(10)
        if end == "copy failed":
            raise OSError("copy failed")

    mirrored = dataclasses.replace(engine.engine.kv_cache(), mirrored=True, stage_out=stage_out)
    worker, side = make_prefill_worker(engine, mirrored)
    try:
        answer = asyncio.ensure_future(
            anext(worker.generate(prefill_request(engine, "prefill-first"), Context("req")))
        )
        await wait_until(staging.is_set, 10, "the held blocks staged out")
        if end == "cancelled":
            answer.cancel()
            with pytest.raises(asyncio.CancelledError):
                await answer
        await engine.kv_dump()
        assert list(engine.engine.scheduler.held) == [HANDLE]  # not freed while being copied
        staged.set()
        if end == "copy failed":
            with pytest.raises(OSError, match="copy failed"):
                await answer
        await wait_until(
            lambda: engine.stats().kv_blocks_used == 0, 5, "held blocks freed once staged out"
        )
        await assert_all_free(engine)
        await assert_released_once(engine, side)
    finally:
        staged.set()
        await side.close()


async def test_a_push_cancelled_while_its_writes_stop_frees_the_blocks_once_stopped(
    prefill_side: PrefillSide,
) -> None:
    """Decode-first: the blocks a push wrote from are freed once no write reads them, even if
    the request is cancelled while the push waits for its writes to stop."""
    stopping, stopped = threading.Event(), threading.Event()

    def stop() -> None:
        stopping.set()
        assert stopped.wait(10)

    pusher = SimpleNamespace(target=kv_target(4, 2), finish=lambda blocks: None, stop=stop)
    claim = SimpleNamespace(accepted=AsyncMock(return_value=True), report=AsyncMock())
    out = EngineOutput(request_id="r", token_ids=[42], kv_blocks=[1, 2])
    pushing = asyncio.ensure_future(
        prefill_side._push("h", out, claim, pusher)  # type: ignore[arg-type]
    )
    try:
        await wait_until(stopping.is_set, 10, "the push's writes stopping")
        pushing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pushing
        released = prefill_side.engine.released  # type: ignore[attr-defined]
        assert released == []  # not while a write may still read them
        stopped.set()
        await wait_until(lambda: released == ["h"], 5, "the pushed blocks released")
    finally:
        stopped.set()
