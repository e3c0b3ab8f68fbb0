"""A routed request counts on its worker from the moment it is sent, not from the worker's first
answer (a prefill worker's answer comes once the whole prompt is computed): a burst of requests
routed at once spreads over the workers instead of piling onto the one that looked idlest when
they arrived. Every way a frontend sends a request: the PrefillRouter's, `follow` (a whole
request, or a decode worker's part), and prefill-first's decode worker, chosen on arrival and
sent the request once the prefill is done. That decode worker counts the request's blocks but
none of its prompt as prefill pending there, unless the prefill failed and it computes it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from kvbaton.protocols.llm import (
    DisaggregatedParams,
    EngineOutput,
    KvPoolInfo,
    PreprocessedRequest,
)
from kvbaton.router.disagg import Disaggregated, follow
from kvbaton.router.indexer import KvIndexer
from kvbaton.router.kv_router import KvRouter
from kvbaton.router.policies import RouteRequest
from kvbaton.router.prefill_router import PrefillRouter
from kvbaton.runtime import Client, Context, DistributedRuntime
from tests.helpers import collect, wait_until

BLOCK = 16
BURST = 6


def params(instance_id: int) -> DisaggregatedParams:
    pool = KvPoolInfo(layout="x", num_blocks=1, block_bytes=1, host="h")
    return DisaggregatedParams(
        prefill_instance_id=instance_id,
        prefill_component="ns.prefill",
        handle="h",
        block_ids=[0],
        num_tokens=1,
        block_size=BLOCK,
        first_token_ids=[1],
        pool=pool,
    )


class Workers:
    """Two workers of an endpoint whose answers wait until `answer` is set (a prefill worker's
    with `DisaggregatedParams`); the requests each has taken."""

    def __init__(self, discovery: str, endpoint: str, answer: asyncio.Event, prefill: bool) -> None:
        self.endpoint = endpoint
        self.answer = answer
        self.prefill = prefill
        self.taken: dict[int, int] = {}
        self.runtimes = [DistributedRuntime(discovery) for _ in range(2)]
        self.tasks = [
            asyncio.create_task(
                r.endpoint(endpoint).serve_endpoint(
                    self._handler(r), request_type=PreprocessedRequest
                )
            )
            for r in self.runtimes
        ]

    def _handler(self, runtime: DistributedRuntime) -> Callable[..., AsyncIterator[EngineOutput]]:
        async def generate(
            request: PreprocessedRequest, ctx: Context
        ) -> AsyncIterator[EngineOutput]:
            assert runtime.instance_id is not None
            self.taken[runtime.instance_id] = self.taken.get(runtime.instance_id, 0) + 1
            await self.answer.wait()  # computing
            yield EngineOutput(
                request_id=ctx.id,
                token_ids=[1],
                disaggregated_params=params(runtime.instance_id) if self.prefill else None,
            )

        return generate

    async def client(self, caller: DistributedRuntime) -> Client:
        client = await caller.endpoint(self.endpoint).client(response_type=EngineOutput)
        await wait_until(lambda: len(client.instance_ids()) == 2, what=f"both {self.endpoint}")
        return client

    def spread(self) -> bool:
        return sorted(self.taken.values()) == [BURST // 2] * 2

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for runtime in self.runtimes:
            await runtime.shutdown()


def kv_router_preferring_the_second(client: Client) -> KvRouter:
    """A KV router of `client`'s workers where the first caches a block: ties go to the other
    one, whatever the candidates' order."""
    indexer = KvIndexer()
    indexer.store(client.instance_ids()[0], [12345])
    return KvRouter(indexer, BLOCK)


def prompt(i: int) -> list[int]:
    return [i * 1000 + t for t in range(4 * BLOCK)]


@dataclass
class Cluster:
    """Two prefill and two decode workers whose answers wait for `computed` and `decoded`,
    their clients, and the runtime of the caller (the frontend)."""

    caller: DistributedRuntime
    prefill_workers: Workers
    decode_workers: Workers
    prefill_client: Client
    decode_client: Client
    computed: asyncio.Event
    decoded: asyncio.Event


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[Cluster]:
    discovery = f"mem://{uuid.uuid4().hex}"
    computed, decoded = asyncio.Event(), asyncio.Event()
    prefill_workers = Workers(discovery, "ns.prefill.generate", computed, prefill=True)
    decode_workers = Workers(discovery, "ns.backend.generate", decoded, prefill=False)
    caller = DistributedRuntime(discovery)
    try:
        yield Cluster(
            caller,
            prefill_workers,
            decode_workers,
            await prefill_workers.client(caller),
            await decode_workers.client(caller),
            computed,
            decoded,
        )
    finally:
        await caller.shutdown()
        await prefill_workers.stop()
        await decode_workers.stop()


@pytest.mark.parametrize("path", ["prefill router", "follow", "prefill-first decode"])
async def test_a_burst_spreads_over_the_workers(path: str) -> None:
    burst: list[asyncio.Task[list[int]]] = []
    async with cluster() as c:
        try:
            prefill_router = PrefillRouter(
                c.caller, c.prefill_client, kv_router_preferring_the_second(c.prefill_client)
            )
            decode_router = kv_router_preferring_the_second(c.decode_client)

            async def send(i: int) -> list[int]:
                request = PreprocessedRequest(model="m", token_ids=prompt(i))
                hints = RouteRequest(prompt(i))
                if path == "prefill router":
                    candidates = c.prefill_client.instance_ids()
                    out = await prefill_router.prefill(request, f"r{i}", hints, candidates, [])
                    return out.token_ids
                route = decode_router.route(hints, c.decode_client.instance_ids())
                if path == "follow":
                    outputs = follow(c.decode_client.ordered(request, route.ranking), route, [])
                else:
                    outputs = Disaggregated(
                        *(prefill_router, c.decode_client, request, f"r{i}", hints),
                        *(c.prefill_client.instance_ids(), route, [], True),
                    ).prefill_first()
                return [t for out in await collect(outputs) for t in out.token_ids]

            burst += [asyncio.create_task(send(i)) for i in range(BURST)]
            if path == "prefill-first decode":  # the prefills end together, after every arrival
                await wait_until(c.prefill_workers.spread, what="the prefills spread")
                c.computed.set()
            workers = c.prefill_workers if path == "prefill router" else c.decode_workers
            await wait_until(lambda: sum(workers.taken.values()) == BURST, what="every request")
            assert workers.spread(), workers.taken
            c.computed.set()
            c.decoded.set()
            tokens = [1, 1] if path == "prefill-first decode" else [1]  # prefill's, decode's
            assert await asyncio.gather(*burst) == [tokens] * BURST
            await prefill_router.close()
        finally:
            for task in burst:
                task.cancel()


@pytest.mark.parametrize("prefill", ["answers", "fails"])
async def test_a_decode_worker_sent_the_kv_counts_no_prefill_of_it(prefill: str) -> None:
    async with cluster() as c:
        prefill_router = PrefillRouter(c.caller, c.prefill_client, KvRouter(KvIndexer(), BLOCK))
        decode_router = KvRouter(KvIndexer(), BLOCK)
        hints = RouteRequest(prompt(0))
        route = decode_router.route(hints, c.decode_client.instance_ids())
        live = c.prefill_client.instance_ids() if prefill == "answers" else []  # [] fails
        outputs = Disaggregated(
            *(prefill_router, c.decode_client, PreprocessedRequest(model="m", token_ids=prompt(0))),
            *("r", hints, live, route, [], False),
        ).prefill_first()
        request = asyncio.create_task(collect(outputs))
        decode_worker = route.ranking[0]
        active = decode_router.active

        def counts() -> tuple[int, int]:
            return active.prefill_tokens(decode_worker), active.active_blocks(decode_worker)

        if prefill == "answers":
            await wait_until(lambda: sum(c.prefill_workers.taken.values()) == 1, what="a prefill")
            assert counts() == (0, 5)  # 4 blocks and a partial one
            c.computed.set()
        await wait_until(lambda: c.decode_workers.taken == {decode_worker: 1}, what="the decode")
        assert counts() == (0 if prefill == "answers" else 4 * BLOCK, 5)
        c.decoded.set()
        await request
        assert len(active) == 0
        await prefill_router.close()
