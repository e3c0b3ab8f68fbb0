"""Router replica sync between two frontends' KV routers (real runtimes, the request plane):
each counts the other's requests as they are added, prefilled and freed; a late follower starts
from a snapshot; a frontend that goes takes its requests out of the other's counts; and two
requests through the two frontends go to two workers where, alone, both would pick one."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from kvbaton.router.indexer import KvIndexer
from kvbaton.router.kv_router import KvRouter
from kvbaton.router.policies import RouteRequest
from kvbaton.router.replica_sync import ReplicaSync
from kvbaton.runtime import DistributedRuntime
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

BLOCK = 4
COMPONENT = "ns.backend"


@asynccontextmanager
async def routers(discovery: str, *models: str) -> AsyncIterator[dict[str, KvRouter]]:
    """A frontend's KV routers, one per model, all on `COMPONENT`: the other frontends of
    `discovery` count their requests, and they the others'."""
    async with DistributedRuntime(discovery, lease_ttl=2) as runtime:
        sync = ReplicaSync(runtime, "ns")
        by_model = {
            model: KvRouter(KvIndexer(), BLOCK, model=model, component=COMPONENT, sync=sync)
            for model in models
        }
        running = asyncio.create_task(sync.run())
        try:
            yield by_model
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


@asynccontextmanager
async def frontend(discovery: str) -> AsyncIterator[KvRouter]:
    """A frontend with one KV router."""
    async with routers(discovery, "m") as by_model:
        yield by_model["m"]


def prompt(i: int) -> list[int]:
    return [i * 100 + t for t in range(16)]  # 4 blocks, none shared with another prompt


async def test_each_counts_the_others_requests_from_a_snapshot_on() -> None:
    discovery = f"mem://{uuid.uuid4().hex}"
    async with frontend(discovery) as a:
        early = a.route(RouteRequest(prompt(0)), [1])
        early.start(1)
        async with frontend(discovery) as b:
            await wait_until(lambda: b.active.requests(1) == 1, 10, "b counting a's request")
            assert b.active.prefill_tokens(1) == 16

            later = b.route(RouteRequest(prompt(1)), [2])
            later.start(2)
            await wait_until(lambda: a.active.requests(2) == 1, 10, "a counting b's request")
            assert a.active.active_blocks(2) == 5  # its 4 blocks and its partial one
            later.first_token()
            await wait_until(lambda: a.active.prefill_tokens(2) == 0, 10, "its prefill done")
            later.done()
            await wait_until(lambda: a.active.requests(2) == 0, 10, "a freeing it")

            again = b.route(RouteRequest(prompt(2)), [2])
            again.start(2)
            await wait_until(lambda: a.active.requests(2) == 1, 10, "a counting b's next one")
        # b went: its request leaves a's counts; a's own stay.
        await wait_until(lambda: a.active.requests(2) == 0, 10, "b's requests dropped")
        assert a.active.requests(1) == 1
        early.done()
        assert len(a.active) == 0


def probe(router: KvRouter) -> None:
    route = router.route(RouteRequest(prompt(9)), [7])
    route.start(7)
    route.done()


async def test_two_requests_through_two_frontends_go_to_two_workers() -> None:
    """Without the sync, each frontend sees two idle workers and picks the same one."""
    alone = [KvRouter(KvIndexer(), BLOCK, component=COMPONENT) for _ in range(2)]
    for router in alone:
        probe(router)
    piled = [r.route(RouteRequest(prompt(i)), [1, 2]).ranking[0] for i, r in enumerate(alone)]
    assert piled[0] == piled[1]

    discovery = f"mem://{uuid.uuid4().hex}"
    async with frontend(discovery) as a, frontend(discovery) as b:
        probe(a)  # (the rotations where the routers alone had theirs)
        probe(b)
        first = a.route(RouteRequest(prompt(0)), [1, 2])
        first.start(first.ranking[0])
        await wait_until(lambda: len(b.active) == 1, 10, "b told of a's request")
        second = b.route(RouteRequest(prompt(1)), [1, 2])
        assert second.ranking[0] != first.ranking[0]


async def test_two_models_on_one_component_are_counted_apart() -> None:
    """Workers of two models register on one component (the default "backend"): each model's
    router counts the other frontends' requests of its model only, from the snapshot on too, and
    one model's request ending leaves the other's counted."""
    discovery = f"mem://{uuid.uuid4().hex}"
    async with routers(discovery, "a", "b") as one, routers(discovery, "a", "b") as two:
        of_a = one["a"].route(RouteRequest(prompt(0)), [1])
        of_a.start(1)
        of_b = one["b"].route(RouteRequest(prompt(1)), [2])
        of_b.start(2)

        def counted(routers: dict[str, KvRouter]) -> bool:
            a, b = routers["a"].active, routers["b"].active
            return (len(a), a.requests(1), len(b), b.requests(2)) == (1, 1, 1, 1)

        await wait_until(lambda: counted(two), 10, "each model's request in its router")
        async with routers(discovery, "a", "b") as late:
            await wait_until(lambda: counted(late), 10, "both requests in the snapshot")
        of_a.done()
        await wait_until(lambda: len(two["a"].active) == 0, 10, "a's request freed")
        assert two["b"].active.requests(2) == 1
        of_b.done()
        await wait_until(lambda: len(two["b"].active) == 0, 10, "b's request freed")
