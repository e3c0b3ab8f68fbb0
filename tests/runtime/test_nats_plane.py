"""What only the nats request plane does: sequence numbers (a lost message breaks the stream,
never a silent gap), liveness without a connection (heartbeats, peer timeout), the hello that
makes an unserved address a ConnectError, messages split to the NATS max payload, idle
connections closed, and a NATS server restart. On a nats-server of this module's own."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvbaton.protocols.frames import Data, Request
from kvbaton.runtime import (
    ConnectError,
    Context,
    DistributedRuntime,
    FrameError,
    HandlerError,
    StreamBrokenError,
)
from kvbaton.runtime.request_plane import nats_plane, nats_transport
from kvbaton.runtime.request_plane.framing import (
    FrameDecoder,
    encode_frame,
    encode_payload,
    payload_decoder,
)
from kvbaton.runtime.request_plane.nats_plane import NatsRequestClient, NatsRequestServer
from kvbaton.runtime.request_plane.nats_transport import (
    ACK,
    DATA,
    DATA_ACK,
    RESET,
    NatsTransport,
    pack_message,
)
from kvbaton.runtime.request_plane.stream import ClientConnection
from kvbaton.runtime.settings import RuntimeSettings
from tests.conftest import WorkerFactory
from tests.helpers import collect, wait_until
from tests.servers import NatsServer, running

pytestmark = pytest.mark.integration

RuntimeFactory = Callable[..., Awaitable[DistributedRuntime]]
PEER_TIMEOUT = 1.0
SLACK = 0.75  # the liveness check runs every peer_timeout / 8; a loaded 2-core machine


@pytest.fixture(scope="module")
def nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with running(NatsServer(tmp_path_factory.mktemp("nats-plane"))) as server:
        yield server


@pytest.fixture
async def make_runtime(nats: NatsServer) -> AsyncIterator[RuntimeFactory]:
    runtimes: list[DistributedRuntime] = []
    discovery = f"mem://{uuid.uuid4().hex}"

    async def make(**overrides: Any) -> DistributedRuntime:
        settings: dict[str, Any] = {
            "discovery": discovery,
            "request_plane": "nats",
            "nats_url": nats.url,
            "lease_ttl": 2.0,
            "peer_timeout": PEER_TIMEOUT,
        }
        runtime = DistributedRuntime(**{**settings, **overrides})
        runtimes.append(runtime)
        return runtime

    yield make
    for runtime in runtimes:
        await asyncio.wait_for(runtime.shutdown(), 15)


async def serve(runtime: DistributedRuntime, path: str, handler: Any) -> NatsRequestServer:
    task = asyncio.create_task(runtime.endpoint(path).serve_endpoint(handler))
    while (
        runtime.instance_id is None or runtime._server is None or path not in runtime._server.routes
    ):
        await asyncio.sleep(0.001)
        if task.done():
            task.result()
    assert isinstance(runtime._server, NatsRequestServer)
    return runtime._server


def nats_client(runtime: DistributedRuntime) -> NatsRequestClient:
    plane = runtime.request_client.plane("nats")
    assert isinstance(plane, NatsRequestClient)
    return plane


class Hold:
    """A handler that yields `first` then waits, streaming nothing, until stopped."""

    def __init__(self, every: float = 0.0) -> None:
        self.every = every
        self.started = asyncio.Event()
        self.stopped = asyncio.Event()

    async def __call__(self, request: Any, ctx: Context) -> AsyncIterator[Any]:
        self.started.set()
        try:
            yield "first"
            i = 0
            while not ctx.is_stopped():
                await asyncio.sleep(self.every or 0.01)
                if self.every:
                    i += 1
                    yield i
        finally:
            self.stopped.set()


class FakeNats:
    """What a carrier uses of a nats-py client, recording what is published."""

    max_payload = 1024
    is_connected = True

    def __init__(self) -> None:
        self.stats = {"reconnects": 0}
        self.published: list[tuple[str, bytes, str]] = []

    def new_inbox(self) -> str:
        return "_INBOX.fake"

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "") -> None:
        assert len(payload) <= self.max_payload
        self.published.append((subject, bytes(payload), reply))


async def fake_link() -> tuple[FakeNats, NatsTransport, ClientConnection]:
    fake = FakeNats()
    client = NatsRequestClient(RuntimeSettings(), None)  # type: ignore[arg-type]
    carrier = nats_plane.ClientCarrier(client, fake, "nats://fake:4222")  # type: ignore[arg-type]
    link = carrier.connect("nats://fake:4222/kvbaton.rp.x", "kvbaton.rp.x")
    assert isinstance(link.protocol, ClientConnection)
    return fake, link, link.protocol


async def test_frames_are_split_at_their_boundaries_into_numbered_messages() -> None:
    fake, link, conn = await fake_link()
    assert conn.max_frame_bytes == 1024 - 9 - 4  # capped: a frame always fits one message
    with pytest.raises(FrameError, match="over the limit"):
        conn.open("ns.c.e", encode_payload(b"x" * 1100), "r", None, payload_decoder())
    payloads = [encode_payload("x" * (100 + 37 * i)) for i in range(20)]
    for i, payload in enumerate(payloads):  # one event-loop turn: written as one buffer
        conn.open("ns.c.e", payload, f"r{i}", None, payload_decoder())
    await wait_until(lambda: len(fake.published) >= 5, 2, "published")
    await asyncio.sleep(0.01)
    frames = []
    for seq, (subject, message, reply) in enumerate(fake.published):
        assert (subject, reply) == ("kvbaton.rp.x", f"{link.reply}.{seq}")
        kind, number = nats_transport.MESSAGE_HEADER.unpack_from(message)
        assert (kind, number) == (DATA, seq)
        decoder = FrameDecoder(conn.max_frame_bytes)
        frames += decoder.feed(message[nats_transport.MESSAGE_HEADER.size :])
        assert decoder.buffered == 0  # whole frames only
    assert [f.payload for f in frames if isinstance(f, Request)] == payloads
    await link.carrier.aclose()


async def test_a_gap_fed_to_the_transport_breaks_its_streams_and_resets_the_peer() -> None:
    fake, link, conn = await fake_link()
    stream = conn.open("ns.c.e", encode_payload(None), "r", None, payload_decoder())
    data = encode_frame(Data(stream.stream_id, [encode_payload("a")]), 1000)
    link.message_received(pack_message(DATA, 0, data))
    assert await stream.__anext__() == "a"
    link.message_received(pack_message(DATA, 2, data))  # #1 never came
    with pytest.raises(StreamBrokenError, match=r"lost \(expected #1, got #2\)"):
        await asyncio.wait_for(stream.__anext__(), 2)
    await wait_until(
        lambda: fake.published[-1] == ("kvbaton.rp.x", pack_message(RESET, 0), f"{link.reply}.r"),
        2,
        "RESET sent",
    )
    assert conn.closed and not link.carrier.links
    await link.carrier.aclose()


async def test_a_request_nats_bounces_is_a_connect_error_an_acknowledged_one_goes_on() -> None:
    fake, link, conn = await fake_link()
    payload = encode_payload(None)
    first = link.expect_delivery()
    stream = conn.open("ns.c.e", payload, "r1", None, payload_decoder())
    first.stream_id = stream.stream_id
    await wait_until(lambda: len(fake.published) == 1, 2, "published")
    _, message, reply = fake.published[0]
    assert message[0] == DATA_ACK and reply == f"{link.reply}.0"  # acknowledge it at once
    link.message_received(pack_message(ACK, 0, nats_transport.ACK_BODY.pack(link.written)))
    await asyncio.wait_for(first.future, 1)  # it reached the server

    late = link.expect_delivery()
    late.stream_id = conn.open("ns.c.e", payload, "r2", None, payload_decoder()).stream_id
    slow = link.expect_delivery()  # a caller that stopped waiting: its stream breaks instead
    slow_stream = conn.open("ns.c.e", payload, "r3", None, payload_decoder())
    slow.stream_id = slow_stream.stream_id
    link.stop_waiting(link.carrier.loop.time() + 1)
    assert slow.future.done() and late.future.done()
    late = link.expect_delivery()
    late.stream_id = conn.open("ns.c.e", payload, "r4", None, payload_decoder()).stream_id
    await wait_until(lambda: len(fake.published) == 2, 2, "published")  # r2 to r4 in #1
    link.bounced(1)  # the server's subject is gone: the messages from #1 on never arrived
    with pytest.raises(ConnectError, match="no responders"):
        await late.future
    assert late.stream_id not in conn.streams  # never sent: the caller tries elsewhere
    for broken in (stream, slow_stream):  # sent, or handed to its caller: those break
        with pytest.raises(StreamBrokenError, match="no responders"):
            await asyncio.wait_for(broken.__anext__(), 1)
    assert all(m[1][:1] != bytes([RESET]) for m in fake.published)  # nobody to tell
    await link.carrier.aclose()


@pytest.mark.parametrize("side", ["caller", "server"])
async def test_a_gap_in_sequence_numbers_breaks_the_stream_on_both_sides(
    make_runtime: RuntimeFactory, side: str
) -> None:
    hold = Hold()
    server = await make_runtime()
    plane_server = await serve(server, "ns.c.hold", hold)
    caller = await make_runtime()
    client = await caller.endpoint("ns.c.hold").client()
    await client.wait_for_instances()
    stream = client.round_robin(None)
    assert await stream.__anext__() == "first"
    if side == "caller":
        link = nats_client(caller).transport(plane_server.address)
    else:
        assert plane_server._server is not None
        (link,) = plane_server._server.links.values()
    assert isinstance(link, NatsTransport)
    link.message_received(pack_message(DATA, link.rx_seq + 1))  # as if one message was lost
    t0 = time.monotonic()
    with pytest.raises(StreamBrokenError, match="lost" if side == "caller" else "dropped"):
        await asyncio.wait_for(stream.__anext__(), 5)
    await asyncio.wait_for(hold.stopped.wait(), 5)
    assert time.monotonic() - t0 < PEER_TIMEOUT / 2, "told at once, not by the peer timeout"
    await wait_until(lambda: not plane_server.connections, timeout=5, what="server conn gone")
    assert nats_client(caller).connections() == []
    assert await collect(client.round_robin(None), limit=1) == ["first"]  # on a new connection


async def test_an_address_nobody_serves_is_a_connect_error_at_once(
    make_runtime: RuntimeFactory, nats: NatsServer
) -> None:
    caller = await make_runtime(connect_timeout=5.0)
    plane = nats_client(caller)
    payload = msgspec.Raw(msgspec.msgpack.encode(None))
    t0 = time.monotonic()
    with pytest.raises(ConnectError, match="nobody serves"):
        await plane.open_stream(
            f"{nats.url}/kvbaton.rp.{uuid.uuid4().hex}", "ns.c.e", payload, request_id="r"
        )
    assert time.monotonic() - t0 < 1.0  # NATS answers "no responders"; no connect timeout
    with pytest.raises(ConnectError, match="not a nats"):
        await plane.open_stream(f"{nats.url}/elsewhere", "ns.c.e", payload, request_id="r")
    assert plane.connections() == [] and plane.open_streams() == 0


async def test_a_server_whose_nats_connection_dies_mid_stream_breaks_it_at_once(
    make_runtime: RuntimeFactory, nats: NatsServer
) -> None:
    hold = Hold()
    server = await make_runtime()
    await serve(server, "ns.c.hold", hold)
    caller = await make_runtime()
    client = await caller.endpoint("ns.c.hold").client()
    await client.wait_for_instances()
    stream = client.round_robin(None)
    assert await stream.__anext__() == "first"
    await asyncio.sleep(PEER_TIMEOUT)  # silent handler: heartbeats keep the stream alive
    # Its subscription goes with it: NATS bounces the caller's next heartbeat.
    await (await server.nats.get(nats.url)).close()
    t0 = time.monotonic()
    with pytest.raises(StreamBrokenError, match="no responders"):
        await asyncio.wait_for(stream.__anext__(), 10)
    assert time.monotonic() - t0 <= PEER_TIMEOUT / 2 + SLACK
    assert caller.request_client.open_streams() == 0


async def test_a_connection_silent_for_the_peer_timeout_is_checked_before_reuse(
    make_runtime: RuntimeFactory, nats: NatsServer
) -> None:
    hold = Hold()
    server = await make_runtime()
    address = (await serve(server, "ns.c.hold", hold)).address
    caller = await make_runtime()
    plane = nats_client(caller)
    payload = msgspec.Raw(msgspec.msgpack.encode(None))
    stream = await plane.open_stream(address, "ns.c.hold", payload, request_id="a")
    assert await stream.__anext__() == "first"
    stream.cancel()
    await asyncio.wait_for(hold.stopped.wait(), 5)  # the Cancel went through
    await (await server.nats.get(nats.url)).close()  # gone while the caller's connection idles
    await asyncio.sleep(PEER_TIMEOUT + 0.1)
    assert plane.connections() == [address]
    with pytest.raises(ConnectError, match="nobody serves"):  # never sent: another may serve it
        await plane.open_stream(address, "ns.c.hold", payload, request_id="b")
    assert plane.connections() == [] and plane.open_streams() == 0


async def test_a_caller_that_vanishes_stops_its_handlers_within_the_peer_timeout(
    make_runtime: RuntimeFactory, nats: NatsServer
) -> None:
    hold = Hold()
    server = await make_runtime()
    plane_server = await serve(server, "ns.c.hold", hold)
    caller = await make_runtime()
    client = await caller.endpoint("ns.c.hold").client()
    await client.wait_for_instances()
    stream = client.round_robin(None)
    assert await stream.__anext__() == "first"
    await (await caller.nats.get(nats.url)).close()
    t0 = time.monotonic()
    await asyncio.wait_for(hold.stopped.wait(), 10)
    assert time.monotonic() - t0 <= PEER_TIMEOUT + SLACK + server.settings.cancel_grace
    assert not plane_server.connections


async def test_a_frozen_worker_then_a_killed_one_break_the_stream_within_the_peer_timeout(
    spawn_worker: WorkerFactory, discovery_url: str, nats: NatsServer
) -> None:
    # (a lease that outlives the freeze: the worker must still be registered after it)
    proc = spawn_worker("--request-plane", "nats", "--nats-url", nats.url, lease_ttl=30.0)
    runtime = DistributedRuntime(discovery_url, nats_url=nats.url, peer_timeout=PEER_TIMEOUT)
    try:
        generate = await runtime.endpoint("t.backend.generate").client()
        await generate.wait_for_instances(timeout=30)
        for signum, reason in [
            (signal.SIGSTOP, "no sign of life"),  # its subscription stays; nothing answers
            (signal.SIGKILL, "no responders|no sign of life"),  # NATS drops its subscription
        ]:
            stream = generate.round_robin({"n": 100_000, "delay": 0.2})
            assert (await stream.__anext__())["pid"] == proc.pid
            proc.send_signal(signum)
            t0 = time.monotonic()
            with pytest.raises(StreamBrokenError, match=reason):
                async with asyncio.timeout(10):
                    async for _ in stream:
                        pass
            assert time.monotonic() - t0 <= PEER_TIMEOUT + SLACK
            if signum == signal.SIGSTOP:
                proc.send_signal(signal.SIGCONT)  # alive again: new requests are served
    finally:
        await runtime.shutdown()


async def test_big_responses_are_split_into_messages_and_too_big_ones_refused(
    make_runtime: RuntimeFactory,
) -> None:
    chunk = 300_000  # several coalesced responses are over the 1 MB max payload

    async def big(n: int, ctx: Context) -> AsyncIterator[bytes]:
        for i in range(n):
            yield bytes([i % 256]) * chunk

    async def huge(request: Any, ctx: Context) -> bytes:
        return b"x" * 2_000_000

    server = await make_runtime()
    await serve(server, "ns.c.big", big)
    await serve(server, "ns.c.huge", huge)
    caller = await make_runtime()
    client = await caller.endpoint("ns.c.big").client()
    huge_client = await caller.endpoint("ns.c.huge").client()
    await client.wait_for_instances()
    await huge_client.wait_for_instances()
    got = await collect(client.round_robin(20))
    assert got == [bytes([i]) * chunk for i in range(20)]
    with pytest.raises(HandlerError) as info:  # a frame over the max payload: that stream only
        await collect(huge_client.round_robin(None))
    assert info.value.error_type == "FrameError"
    with pytest.raises(FrameError, match="over the limit"):
        await client.round_robin(b"x" * 2_000_000)
    assert len(await collect(client.round_robin(3))) == 3


async def test_idle_connections_are_closed_on_both_sides(
    make_runtime: RuntimeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nats_plane.ClientCarrier, "idle_s", 0.3)

    async def one(request: Any, ctx: Context) -> int:
        return 1

    server = await make_runtime(peer_timeout=0.8)
    plane_server = await serve(server, "ns.c.one", one)
    caller = await make_runtime(peer_timeout=0.8)
    client = await caller.endpoint("ns.c.one").client()
    await client.wait_for_instances()
    assert await collect(client.round_robin(None)) == [1]
    assert len(plane_server.connections) == 1
    await wait_until(lambda: not nats_client(caller).connections(), 3, "client closed it")
    await wait_until(lambda: not plane_server.connections, 3, "server forgot it")
    assert await collect(client.round_robin(None)) == [1]


async def test_shutdown_closes_the_callers_connection_then_the_address_is_unserved(
    make_runtime: RuntimeFactory,
) -> None:
    server = await make_runtime()
    plane_server = await serve(server, "ns.c.hold", Hold())
    address = plane_server.address
    caller = await make_runtime()
    client = await caller.endpoint("ns.c.hold").client()
    await client.wait_for_instances()
    assert await collect(client.round_robin(None), limit=1) == ["first"]
    await server.shutdown()
    await wait_until(lambda: not nats_client(caller).connections(), 3, "CLOSE received")
    with pytest.raises(ConnectError, match="nobody serves"):
        await nats_client(caller).open_stream(
            address, "ns.c.hold", msgspec.Raw(msgspec.msgpack.encode(None)), request_id="r"
        )


async def test_a_nats_restart_breaks_streams_in_flight_then_new_requests_succeed(
    make_runtime: RuntimeFactory, nats: NatsServer
) -> None:
    hold = Hold(every=0.02)
    server = await make_runtime()
    await serve(server, "ns.c.hold", hold)
    caller = await make_runtime()
    client = await caller.endpoint("ns.c.hold").client()
    await client.wait_for_instances()
    stream = client.round_robin(None)
    got = [await stream.__anext__() for _ in range(5)]
    assert got == ["first", 1, 2, 3, 4]
    restart = asyncio.create_task(asyncio.to_thread(nats.restart))
    previous = got[-1]
    with pytest.raises(StreamBrokenError):
        async with asyncio.timeout(15):
            async for item in stream:  # nothing missing, nothing out of order, until it breaks
                assert item == previous + 1
                previous = item
    await asyncio.wait_for(hold.stopped.wait(), 15)
    await restart
    connections = [await rt.nats.get(nats.url) for rt in (server, caller)]
    await wait_until(lambda: all(nc.is_connected for nc in connections), 10, "reconnected")
    for _ in range(3):
        assert await collect(client.round_robin(None), limit=3) == ["first", 1, 2]


def test_addresses_are_parsed_or_refused(tmp_path: Path) -> None:
    url, subject = nats_transport.parse_address("nats://127.0.0.1:4222/kvbaton.rp.ab12")
    assert (url, subject) == ("nats://127.0.0.1:4222", "kvbaton.rp.ab12")
    for bad in ["tcp://127.0.0.1:1/kvbaton.rp.x", "nats://h:1", "nats://h:1/other.subject"]:
        with pytest.raises(ConnectError):
            nats_transport.parse_address(bad)
