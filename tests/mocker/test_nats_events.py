"""What only the NATS event plane has: the plane itself (subjects, bounded queues, closing, a
server that is not there), messages that are lost or come from strangers, and a server restart
while the worker's cache keeps changing. The tests common to both planes are in
test_kv_events.py."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from kvbaton.mocker import MockerTiming, create_mocker_engine
from kvbaton.mocker.runner import mocker_config
from kvbaton.protocols.kv import BlockRemoved, BlockStored, KvDump, KvEventBatch
from kvbaton.router.indexer import KvIndexer
from kvbaton.router.kv_events import KvEventSubscriber
from kvbaton.runtime import ConnectError, DistributedRuntime
from kvbaton.runtime.event_plane import EventPlane, event_pattern, event_subject, instance_of
from kvbaton.workers.kv_publisher import KvEventPublisher
from kvbaton.workers.llm_worker import LLMWorker
from tests.helpers import collect, idle_load, wait_until
from tests.mocker.kv_setup import Setup, kv_setup
from tests.servers import NatsServer, free_port, running

pytestmark = pytest.mark.unit

encode = msgspec.msgpack.Encoder().encode


@contextlib.asynccontextmanager
async def plane_on(url: str) -> AsyncIterator[EventPlane]:
    async with DistributedRuntime(f"mem://{uuid.uuid4().hex}", event_plane=url) as runtime:
        plane = EventPlane.of(runtime)
        assert plane is not None
        yield plane


async def dump_of(setup: Setup) -> KvDump:
    client = await setup.worker_rt.endpoint("t.backend.kv_dump").client(response_type=KvDump)
    try:
        (dump,) = await collect(client.direct(None, setup.worker_id))
        return dump  # type: ignore[no-any-return]
    finally:
        await client.close()


def index_is(setup: Setup, dump: KvDump) -> bool:
    """The index holds exactly the dump's blocks for the worker."""
    index, worker = setup.indexer, setup.worker_id
    return index.tree_size(worker) == len(dump.block_hashes) and all(
        index.find_matches([h]) == {worker: 1} for h in dump.block_hashes
    )


async def test_messages_travel_by_subject_in_order_and_queues_are_bounded(
    nats_server: NatsServer,
) -> None:
    subject = event_subject("ns", "comp", "topic", 0xBEEF)
    assert subject == "kvbaton.events.ns.comp.topic.beef"
    assert instance_of(subject) == 0xBEEF and instance_of("kvbaton.events.x") is None
    with pytest.raises(ValueError, match="component"):
        event_pattern("ns", "a.b", "topic")
    async with plane_on(nats_server.url) as plane:
        sub = await plane.subscribe(event_pattern("ns", "comp", "topic"))
        small = await plane.subscribe(event_pattern("ns", "comp", "topic"), max_pending=2)
        for i in range(5):
            await plane.publish(subject, bytes([i]))
        await plane.publish(event_subject("ns", "comp", "other", 1), b"not for us")
        await plane.flush()
        received = [await anext(sub) for _ in range(5)]
        assert received == [(subject, bytes([i])) for i in range(5)]
        await wait_until(lambda: small.dropped == 3, what="the overflow")
        assert [(await anext(small))[1] for _ in range(2)] == [b"\x00", b"\x01"]
        await sub.close()
        await small.close()
        assert [m async for m in sub] == []  # a closed subscription ends


ROOM_BYTES = 19  # what the plane takes beside a load report and its last event id


async def test_published_batches_keep_their_order_fit_the_plane_and_carry_the_load() -> None:
    publisher = KvEventPublisher()
    sent: list[KvEventBatch] = []
    sizes: list[int] = []

    async def send(data: bytes) -> None:
        sizes.append(len(data))
        sent.append(msgspec.msgpack.decode(data, type=KvEventBatch))

    load = idle_load()
    publisher.start(lambda: load)
    # A plane that takes a load report and its last event id and little more.
    report = KvEventBatch(load=load, last_event_id=59)
    max_bytes = len(msgspec.msgpack.encode(report)) + ROOM_BYTES
    publishing = asyncio.create_task(publisher.publish(send, max_bytes))
    await wait_until(lambda: any(b.load == load for b in sent), what="the first load")
    for i in range(60):  # one wake-up's worth: more than one message of max_bytes
        block = BlockStored(
            event_id=i, block_hashes=[i], parent_hash=None, token_ids=[i] * 4, block_size=4
        )
        publisher.on_event(block)
    await wait_until(lambda: sum(len(b.events) for b in sent) == 60, what="the events")
    loads = sum(b.load is not None for b in sent)
    await wait_until(lambda: sum(b.load is not None for b in sent) > loads, 3, "a refresh")
    publisher.close()
    await asyncio.wait_for(publishing, 5)
    assert [e.event_id for b in sent for e in b.events] == list(range(60))
    assert len([b for b in sent if b.events]) > 1 and max(sizes) <= max_bytes
    # The last part of each batch says which event was the last one sent, and so do the
    # refreshes after it (the parts before it say nothing: their successor is on its way).
    assert sent[-1].last_event_id == 59 and not sent[-1].events
    told = [b for b in sent if b.events and b.last_event_id is not None]
    assert told and all(b.last_event_id == b.events[-1].event_id for b in told)


async def test_a_nats_server_that_is_not_there_is_a_connect_error(mocker_model: Path) -> None:
    nowhere = f"nats://127.0.0.1:{free_port()}"
    url = f"mem://{uuid.uuid4().hex}"
    async with DistributedRuntime(url, event_plane=nowhere, connect_timeout=0.5) as runtime:
        subscriber = KvEventSubscriber(runtime, "t.backend", KvIndexer(), {})
        with pytest.raises(ConnectError, match="NATS"):
            await subscriber.start()
        await subscriber.close()
        publisher = KvEventPublisher()
        config = mocker_config(model=str(mocker_model), num_kv_blocks=16, block_size=4)
        engine = await create_mocker_engine(config, MockerTiming(), publisher.on_event)
        worker = LLMWorker(runtime, engine, served_name="m", namespace="t", kv_events=publisher)
        with pytest.raises(ConnectError, match="NATS"):
            await worker.serve()


async def test_events_go_by_nats_and_lost_or_strange_messages_are_handled(
    mocker_model: Path, nats_server: NatsServer
) -> None:
    async with kv_setup(mocker_model, nats_server.url) as setup:
        kv_events = await setup.worker_rt.endpoint("t.backend.kv_events").client()
        assert kv_events.instance_ids() == []  # the events go by NATS, not by an endpoint
        await kv_events.close()
        await setup.subscriber.start()
        await wait_until(lambda: setup.subscriber.dumps == 1, what="the first dump")
        prompt = list(range(30, 39))
        await setup.run(prompt)
        await wait_until(lambda: setup.matches(prompt) == {setup.worker_id: 2}, what="the index")
        hashes = (await dump_of(setup)).block_hashes
        async with plane_on(nats_server.url) as plane:
            # A stranger's events, and garbage from the worker: ignored.
            stranger = event_subject("t", "backend", "kv_events", 0xDEAD)
            stored = BlockStored(
                event_id=0, block_hashes=[7], parent_hash=None, token_ids=[1] * 4, block_size=4
            )
            await plane.publish(stranger, encode(KvEventBatch(events=[stored])))
            own = event_subject("t", "backend", "kv_events", setup.worker_id)
            await plane.publish(own, b"\xc1 not msgpack")
            # An event after one that was lost: not applied; the gap brings a dump.
            last = (await dump_of(setup)).last_event_id
            lost = BlockRemoved(event_id=last + 2, block_hashes=hashes)
            await plane.publish(own, encode(KvEventBatch(events=[lost])))
            await wait_until(lambda: setup.subscriber.dumps == 2, what="a re-sync")
            # A quiet worker whose last events were lost: no later event shows the gap, but
            # its next message says which event it sent last; that brings a dump too.
            quiet = KvEventBatch(last_event_id=(await dump_of(setup)).last_event_id + 3)
            await plane.publish(own, encode(quiet))
            await wait_until(lambda: setup.subscriber.dumps == 3, what="a re-sync when quiet")
        await wait_until(lambda: setup.matches(prompt) == {setup.worker_id: 2}, what="re-sync")
        assert setup.indexer.workers == [setup.worker_id]
        loads = setup.subscriber.loads
        await wait_until(lambda: list(loads) == [setup.worker_id], what="a load (refreshed)")
        second = list(range(80, 89))
        await setup.run(second)  # events flow again after the re-sync
        await wait_until(lambda: setup.matches(second) == {setup.worker_id: 2}, what="events")
        assert setup.subscriber.dumps == 3


async def test_the_index_converges_after_a_nats_restart(mocker_model: Path, tmp_path: Path) -> None:
    with running(NatsServer(tmp_path / "nats")) as server:
        async with kv_setup(mocker_model, server.url) as setup:
            await setup.subscriber.start()
            await wait_until(lambda: setup.subscriber.dumps == 1, what="the first dump")

            async def churn(stop: asyncio.Event) -> int:  # 64 blocks: stores and evictions
                n = 0
                while not stop.is_set():
                    await setup.run([n % 50 + 100 * (n % 3), *range(8)])
                    n += 1
                    await asyncio.sleep(0.005)
                return n

            async def converged() -> None:
                for _ in range(200):
                    if index_is(setup, await dump_of(setup)):
                        return
                    await asyncio.sleep(0.05)
                assert index_is(setup, await dump_of(setup))

            # The cache keeps changing while the server restarts.
            stop = asyncio.Event()
            churning = asyncio.create_task(churn(stop))
            await asyncio.sleep(0.3)
            await asyncio.to_thread(server.restart)
            await asyncio.sleep(0.5)
            stop.set()
            assert await churning > 20
            await wait_until(lambda: setup.subscriber.dumps >= 2, what="a re-sync")
            await converged()

            # Every event of an outage lost, and none after it to show a gap: only the
            # re-sync on reconnecting brings the index back.
            dumps = setup.subscriber.dumps
            deliver = setup.publisher._fan_out
            setup.publisher._fan_out = lambda event: None  # type: ignore[method-assign]
            await asyncio.to_thread(server.stop)
            stop = asyncio.Event()
            churning = asyncio.create_task(churn(stop))
            await asyncio.sleep(0.3)
            stop.set()
            assert await churning > 10
            setup.publisher._fan_out = deliver  # type: ignore[method-assign]
            await asyncio.to_thread(server.start)
            await wait_until(lambda: setup.subscriber.dumps > dumps, what="a re-sync")
            await converged()
