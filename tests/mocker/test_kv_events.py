"""KV events, on both event planes (broker-free `direct`, and `nats` on a real nats-server): a
router's index follows a worker's cache through the worker's events, starting from its
`kv_dump`; a gap re-syncs it from a new dump; a worker that leaves is taken out. A mocker
worker and a subscriber run in one process, on mem discovery and the real request plane.
(What only NATS has, a server restart and lost messages: test_nats_events.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvbaton.llm.hashing import hash_blocks
from kvbaton.protocols.kv import KvEvent
from kvbaton.router.indexer import KvIndexer
from kvbaton.router.kv_events import KvEventSubscriber
from tests.helpers import collect, wait_until
from tests.mocker.kv_setup import BLOCK, Setup, kv_setup

pytestmark = pytest.mark.unit


@pytest.fixture(params=["direct", "nats"])
async def setup(request: pytest.FixtureRequest, mocker_model: Path) -> AsyncIterator[Setup]:
    plane = request.getfixturevalue("nats_server").url if request.param == "nats" else "direct"
    async with kv_setup(mocker_model, plane) as setup:
        yield setup


async def test_the_index_follows_events_and_load_arrives(setup: Setup) -> None:
    await setup.subscriber.start()
    await wait_until(lambda: setup.subscriber.dumps == 1, what="the first dump")
    prompt = list(range(30, 47))  # 4 full blocks and one token
    await setup.run(prompt)
    await wait_until(lambda: setup.matches(prompt) == {setup.worker_id: 4}, what="the index")
    await wait_until(lambda: setup.worker_id in setup.subscriber.loads, what="a load report")
    assert setup.subscriber.loads[setup.worker_id].kv_blocks_total == 64
    clear = await setup.worker_rt.endpoint("t.backend.clear_kv_blocks").client()
    await collect(clear.round_robin(None))
    await wait_until(lambda: setup.matches(prompt) == {}, what="the cleared cache")
    assert setup.subscriber.dumps == 1  # no gap along the way
    await clear.close()


async def test_a_new_subscriber_starts_from_the_dump(setup: Setup) -> None:
    prompt = list(range(60, 73))
    await setup.run(prompt)
    await setup.subscriber.start()
    await wait_until(lambda: setup.matches(prompt) == {setup.worker_id: 3}, what="the dump")


async def test_a_gap_re_syncs_from_a_dump(setup: Setup) -> None:
    await setup.subscriber.start()
    await wait_until(lambda: setup.subscriber.dumps == 1, what="the first dump")
    deliver = setup.publisher._fan_out
    lost: list[KvEvent] = []

    def lossy(event: KvEvent) -> None:  # loses the first event only
        if not lost:
            lost.append(event)
        else:
            deliver(event)

    setup.publisher._fan_out = lossy  # type: ignore[method-assign]
    first, second = list(range(30, 39)), list(range(80, 89))
    await setup.run(first)  # its stored event is lost
    await setup.run(second)  # its event shows the gap
    await wait_until(lambda: setup.subscriber.dumps == 2, what="a re-sync")
    await wait_until(lambda: setup.matches(first) == {setup.worker_id: 2}, what="the lost blocks")
    assert setup.matches(second) == {setup.worker_id: 2}
    assert lost


async def test_a_worker_that_leaves_is_taken_out(setup: Setup) -> None:
    await setup.subscriber.start()
    prompt = list(range(30, 39))
    await setup.run(prompt)
    await wait_until(lambda: setup.matches(prompt) == {setup.worker_id: 2}, what="the index")
    await setup.worker_rt.shutdown()
    await wait_until(lambda: setup.matches(prompt) == {}, what="the worker's removal")
    assert setup.worker_id not in setup.indexer.workers
    assert setup.worker_id not in setup.subscriber.loads


@pytest.mark.parametrize("plane", ["direct", "nats"])
async def test_a_worker_of_another_model_on_the_component_is_not_indexed(
    request: pytest.FixtureRequest, mocker_model: Path, plane: str
) -> None:
    url = request.getfixturevalue("nats_server").url if plane == "nats" else "direct"
    async with kv_setup(mocker_model, url, model="other") as setup:
        ours = KvEventSubscriber(setup.worker_rt, "t.backend", KvIndexer(), {}, "m")
        await asyncio.gather(setup.subscriber.start(), ours.start())
        try:
            await wait_until(lambda: setup.subscriber.others == {setup.worker_id}, what="others")
            prompt = list(range(30, 39))
            await setup.run(prompt)
            found = hash_blocks(prompt, BLOCK)
            await wait_until(lambda: ours.indexer.find_matches(found), what="m's own index")
            await wait_until(lambda: setup.worker_id in ours.loads, what="m's load report")
            assert setup.matches(prompt) == {}
            assert setup.indexer.workers == [] and setup.subscriber.loads == {}
            assert setup.subscriber.dumps == 0 and ours.others == set()
        finally:
            await ours.close()


async def test_a_follower_whose_cancel_was_lost_ends_once_its_worker_left(
    mocker_model: Path,
) -> None:
    """A cancel can be lost (Python 3.11's wait_for swallows one that lands as the awaited call
    ends): the task left over must end, not re-sync with a worker that is gone, forever."""
    async with kv_setup(mocker_model) as setup:
        await setup.subscriber.start()
        await wait_until(lambda: setup.worker_id in setup.subscriber._workers, what="a follower")
        # As if its cancel had been lost: it is no longer the worker's follower.
        leftover = setup.subscriber._workers.pop(setup.worker_id)
        await setup.worker_rt.shutdown()
        await wait_until(leftover.done, timeout=10, what="the leftover follower's end")
