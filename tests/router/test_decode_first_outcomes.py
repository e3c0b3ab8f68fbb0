"""Decode-first: the decode worker may answer a request whole before its prefill worker's call
ends (its answer is late, or it failed and the decode worker computed the prompt). That
prefill is counted if it ends within `SETTLE_S` (a failure as a fallback, with or without
`enforce`), else cancelled; a request that ends early, or the router's close, cancels it at
once."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from kvbaton.protocols.disagg import Accepted, KvAbandon
from kvbaton.protocols.llm import EngineOutput, KvPoolInfo, KvTarget, PreprocessedRequest
from kvbaton.router import prefill_router
from kvbaton.router.disagg import Disaggregated
from kvbaton.router.indexer import KvIndexer
from kvbaton.router.kv_router import KvRouter
from kvbaton.router.policies import RouteRequest
from kvbaton.router.prefill_router import PrefillOutcomes, PrefillRouter
from kvbaton.runtime import Context, DistributedRuntime
from tests.helpers import collect, wait_until

pytestmark = pytest.mark.unit
BLOCK = 16


class Workers:
    """A decode worker that answers a bootstrap with its room, then, once `decoded` is set, the
    whole request; a prefill worker whose call ends once `end` is set, with an answer if
    `answers`, else failing (`taken` once it has the call, `cancelled` if it is cancelled)."""

    def __init__(self, discovery: str) -> None:
        self.decoded = asyncio.Event()
        self.end = asyncio.Event()
        self.answers = False
        self.taken = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.abandoned: list[str] = []
        self.decode = DistributedRuntime(discovery)
        self.prefill = DistributedRuntime(discovery)
        self.tasks = [
            self._serve(self.decode, "ns.backend.generate", self._decode, PreprocessedRequest),
            self._serve(self.decode, "ns.backend.kv_abandon", self._abandon, KvAbandon),
            self._serve(self.prefill, "ns.prefill.generate", self._prefill, PreprocessedRequest),
        ]

    @staticmethod
    def _serve(
        runtime: DistributedRuntime, path: str, handler: object, kind: type
    ) -> asyncio.Task[None]:
        endpoint = runtime.endpoint(path)
        return asyncio.create_task(endpoint.serve_endpoint(handler, request_type=kind))

    async def _decode(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[EngineOutput]:
        assert request.bootstrap and self.decode.instance_id is not None
        pool = KvPoolInfo(layout="x", num_blocks=1, block_bytes=1, host="h")
        target = KvTarget(
            decode_instance_id=self.decode.instance_id,
            decode_component="ns.backend",
            room="room",
            block_ids=[0],
            first_block=0,
            block_size=BLOCK,
            pool=pool,
        )
        yield EngineOutput(request_id=ctx.id, token_ids=[], kv_target=target)
        await self.decoded.wait()
        yield EngineOutput(request_id=ctx.id, token_ids=[1, 2], finish_reason="length")

    async def _abandon(self, abandon: KvAbandon, ctx: Context) -> AsyncIterator[Accepted]:
        self.abandoned.append(abandon.room)
        yield Accepted(accepted=True)

    async def _prefill(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[EngineOutput]:
        self.taken.set()
        try:
            await self.end.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        if not self.answers:
            raise RuntimeError("the prefill worker died")
        yield EngineOutput(request_id=ctx.id, token_ids=[1])

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await self.decode.shutdown()
        await self.prefill.shutdown()


@contextlib.asynccontextmanager
async def decode_first(
    enforce: bool = False,
) -> AsyncIterator[tuple[Workers, PrefillRouter, AsyncIterator[EngineOutput]]]:
    """The workers, the frontend's prefill router and one request's decode-first outputs."""
    discovery = f"mem://{uuid.uuid4().hex}"
    workers = Workers(discovery)
    caller = DistributedRuntime(discovery)
    try:
        prefill = await caller.endpoint("ns.prefill.generate").client(response_type=EngineOutput)
        decode = await caller.endpoint("ns.backend.generate").client(response_type=EngineOutput)
        await wait_until(lambda: prefill.instance_ids() and decode.instance_ids(), what="workers")
        router = PrefillRouter(caller, prefill, KvRouter(KvIndexer(), BLOCK))
        hints = RouteRequest(list(range(2 * BLOCK)))
        route = KvRouter(KvIndexer(), BLOCK).route(hints, decode.instance_ids())
        request = PreprocessedRequest(model="m", token_ids=hints.token_ids)
        outputs = Disaggregated(
            *(router, decode, request, "r", hints, prefill.instance_ids(), route, [], enforce)
        ).decode_first()
        try:
            yield workers, router, outputs
        finally:
            await router.close()
    finally:
        await caller.shutdown()
        await workers.stop()


@pytest.fixture
def settle_s(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Sets `SETTLE_S`; an hour unless a test sets it (nothing then waits on the clock)."""

    def set_to(seconds: float) -> None:
        monkeypatch.setattr(prefill_router, "SETTLE_S", seconds)

    set_to(3600.0)
    return set_to


async def answered_whole(workers: Workers, outputs: AsyncIterator[EngineOutput]) -> None:
    """The request's answer, once the prefill worker has the call (still running after)."""
    request = asyncio.create_task(collect(outputs))
    await asyncio.wait_for(workers.taken.wait(), 10)
    workers.decoded.set()
    assert [out.token_ids for out in await request] == [[1, 2]]


@pytest.mark.parametrize("enforce", [False, True])
async def test_a_prefill_that_fails_after_the_answer_is_a_fallback(
    settle_s: Callable[[float], None], enforce: bool
) -> None:
    async with decode_first(enforce) as (workers, router, outputs):
        await answered_whole(workers, outputs)
        assert router.outcomes == PrefillOutcomes()
        workers.end.set()
        await wait_until(lambda: router.outcomes.fallbacks == 1, what="the fallback counted")
        assert router.outcomes == PrefillOutcomes(fallbacks=1)  # (not a failure: it was served)
        await wait_until(lambda: workers.abandoned == ["room"], what="the room abandoned")
        assert not workers.cancelled.is_set()


async def test_a_prefill_answering_after_the_answer_is_counted(
    settle_s: Callable[[float], None],
) -> None:
    async with decode_first() as (workers, router, outputs):
        await answered_whole(workers, outputs)
        workers.answers = True
        workers.end.set()
        await wait_until(lambda: router.outcomes.answered == 1, what="the answer counted")
        assert router.outcomes == PrefillOutcomes(answered=1) and not workers.abandoned


async def test_a_prefill_that_does_not_settle_is_cancelled(
    settle_s: Callable[[float], None],
) -> None:
    settle_s(0.05)
    async with decode_first() as (workers, router, outputs):
        await answered_whole(workers, outputs)
        await asyncio.wait_for(workers.cancelled.wait(), 10)
        assert router.outcomes == PrefillOutcomes(unsettled=1)


async def test_closing_the_router_cancels_a_settling_prefill(
    settle_s: Callable[[float], None],
) -> None:
    async with decode_first() as (workers, router, outputs):
        await answered_whole(workers, outputs)
        await router.close()
        await asyncio.wait_for(workers.cancelled.wait(), 10)
        assert router.outcomes == PrefillOutcomes()


async def test_a_request_that_ends_early_cancels_its_prefill_at_once(
    settle_s: Callable[[float], None],
) -> None:
    async with decode_first() as (workers, router, outputs):
        request = asyncio.create_task(collect(outputs))
        await asyncio.wait_for(workers.taken.wait(), 10)
        request.cancel()  # the client left before the answer
        await asyncio.wait_for(workers.cancelled.wait(), 10)
        assert router.outcomes == PrefillOutcomes()
