"""The runtime's face in one process: serving, routing, errors, cancellation, deadlines,
shutdown. Every test runs on each discovery backend (with the tcp request plane) and on each
request plane (with mem discovery)."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvbaton.protocols.discovery import Instance
from kvbaton.runtime import (
    BadRequestError,
    ConnectError,
    Context,
    DeadlineExceededError,
    DistributedRuntime,
    EndpointNotFoundError,
    FrameError,
    HandlerError,
    NoInstancesError,
    ShuttingDownError,
)
from tests.helpers import collect, wait_until

pytestmark = pytest.mark.unit

RuntimeFactory = Callable[..., Awaitable[DistributedRuntime]]


BACKENDS = ["mem/tcp", "file/tcp", "etcd/tcp", "kubernetes/tcp", "mem/nats", "mem/http"]


@pytest.fixture(params=BACKENDS)
def backends(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """RuntimeSettings fields for a discovery backend and a request plane."""
    discovery, plane = request.param.split("/")
    settings: dict[str, Any] = {"request_plane": plane}
    if discovery == "mem":
        settings["discovery"] = f"mem://{uuid.uuid4().hex}"
    elif discovery == "file":
        settings["discovery"] = f"file://{tmp_path}/d"
    elif discovery == "kubernetes":
        kube = request.getfixturevalue("kube_standin")
        settings["discovery"] = kube.url(f"t-{uuid.uuid4().hex[:12]}")
    else:
        etcd = request.getfixturevalue("etcd_server")
        settings["discovery"] = f"{etcd.url}/t-{uuid.uuid4().hex}"
    if plane == "nats":
        settings["nats_url"] = request.getfixturevalue("nats_server").url
    return settings


@pytest.fixture
def plane(backends: dict[str, Any]) -> str:
    return str(backends["request_plane"])


@pytest.fixture
async def make_runtime(backends: dict[str, Any]) -> AsyncIterator[RuntimeFactory]:
    runtimes: list[DistributedRuntime] = []

    async def make(**overrides: Any) -> DistributedRuntime:
        overrides.setdefault("lease_ttl", 2.0)
        runtime = DistributedRuntime(**{**backends, **overrides})
        runtimes.append(runtime)
        return runtime

    yield make
    for runtime in runtimes:
        await runtime.shutdown()


async def serve(
    runtime: DistributedRuntime, path: str, handler: Any, **kw: Any
) -> asyncio.Task[None]:
    task = asyncio.create_task(runtime.endpoint(path).serve_endpoint(handler, **kw))
    while (
        runtime.instance_id is None or runtime._server is None or path not in runtime._server.routes
    ):
        await asyncio.sleep(0.001)
        if task.done():
            task.result()
    return task


async def echo(request: Any, context: Context) -> AsyncIterator[Any]:
    for i in range(3):
        if context.is_stopped():
            return
        yield {"i": i, "echo": request}


async def test_the_issue_example_streams_in_order(make_runtime: RuntimeFactory) -> None:
    runtime = await make_runtime()
    await serve(runtime, "demo.backend.generate", echo)
    client = await runtime.endpoint("demo.backend.generate").client()
    assert await client.wait_for_instances() == [runtime.instance_id]
    out = [r async for r in client.round_robin({"hello": 1})]
    assert out == [{"i": i, "echo": {"hello": 1}} for i in range(3)]
    assert client.instance_ids() == [runtime.instance_id]


async def test_round_robin_random_and_direct(make_runtime: RuntimeFactory) -> None:
    servers = [await make_runtime(), await make_runtime()]
    for rt in servers:

        async def who(request: Any, ctx: Context, rt: DistributedRuntime = rt) -> int | None:
            return rt.instance_id

        await serve(rt, "ns.c.who", who)
    caller = await make_runtime()
    client = await caller.endpoint("ns.c.who").client()
    ids = sorted(rt.instance_id for rt in servers if rt.instance_id is not None)
    await wait_until(lambda: client.instance_ids() == ids, what="both instances seen")
    rr = [(await collect(client.round_robin(None)))[0] for _ in range(10)]
    assert rr.count(ids[0]) == rr.count(ids[1]) == 5
    assert all(a != b for a, b in itertools.pairwise(rr))  # alternates
    rnd = {(await collect(client.random(None)))[0] for _ in range(40)}
    assert rnd == set(ids)
    for iid in ids:
        stream = await client.direct(None, iid)
        assert stream.instance_id == iid
        assert [x async for x in stream] == [iid]
    with pytest.raises(NoInstancesError):
        await client.direct(None, 0xDEAD)


async def test_unary_handler_and_struct_types(make_runtime: RuntimeFactory) -> None:
    class Ask(msgspec.Struct):
        a: int
        b: int

    class Sum(msgspec.Struct):
        total: int

    async def add(request: Ask, ctx: Context) -> Sum:
        return Sum(request.a + request.b)

    runtime = await make_runtime()
    await serve(runtime, "ns.math.add", add, request_type=Ask)
    client = await runtime.endpoint("ns.math.add").client(response_type=Sum)
    await client.wait_for_instances()
    assert [r async for r in client.round_robin(Ask(2, 3))] == [Sum(5)]
    with pytest.raises(BadRequestError, match="bad request"):
        async for _ in client.round_robin({"a": "not a number"}):
            pass


async def test_handler_error_reaches_the_caller_typed(make_runtime: RuntimeFactory) -> None:
    async def failing(request: Any, ctx: Context) -> AsyncIterator[int]:
        yield 1
        raise KeyError("no such thing")

    runtime = await make_runtime()
    await serve(runtime, "ns.c.fail", failing)
    client = await runtime.endpoint("ns.c.fail").client()
    await client.wait_for_instances()
    got = []
    with pytest.raises(HandlerError) as info:
        async for item in client.round_robin(None):
            got.append(item)
    assert got == [1]
    assert info.value.error_type == "KeyError"
    assert "no such thing" in info.value.message


async def test_unknown_endpoint_on_an_instance(make_runtime: RuntimeFactory) -> None:
    runtime = await make_runtime()
    task = await serve(runtime, "ns.c.gone", echo)
    client = await runtime.endpoint("ns.c.gone").client()
    await client.wait_for_instances()
    stream = await client.round_robin(None)  # connected and sent...
    assert [x async for x in stream]
    runtime._server.remove_route("ns.c.gone")  # type: ignore[union-attr]
    with pytest.raises(EndpointNotFoundError):
        async for _ in client.round_robin(None):
            pass
    task.cancel()


async def test_break_stops_the_handler_within_milliseconds(make_runtime: RuntimeFactory) -> None:
    stopped_after: list[float] = []
    broke_at: list[float] = []

    async def endless(request: Any, ctx: Context) -> AsyncIterator[int]:
        i = 0
        while True:
            yield i
            i += 1
            await asyncio.sleep(0.001)
            if ctx.is_stopped():
                stopped_after.append(time.monotonic() - broke_at[0])
                return

    runtime = await make_runtime()
    await serve(runtime, "ns.c.endless", endless)
    client = await runtime.endpoint("ns.c.endless").client()
    await client.wait_for_instances()
    async for item in client.round_robin(None):
        if item == 5:
            broke_at.append(time.monotonic())
            break
    for _ in range(500):
        if stopped_after:
            break
        await asyncio.sleep(0.001)
    assert stopped_after and stopped_after[0] < 0.1


async def test_a_handler_that_ignores_stop_is_cancelled_after_the_grace(
    make_runtime: RuntimeFactory,
) -> None:
    events: list[str] = []

    async def stubborn(request: Any, ctx: Context) -> AsyncIterator[int]:
        yield 0
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            events.append("cancelled" if ctx.is_stopped() else "cancelled-unstopped")
            raise

    runtime = await make_runtime(cancel_grace=0.2)
    await serve(runtime, "ns.c.stubborn", stubborn)
    client = await runtime.endpoint("ns.c.stubborn").client()
    await client.wait_for_instances()

    first_read = asyncio.Event()

    async def consume() -> None:
        async for _ in client.round_robin(None):
            first_read.set()

    reader = asyncio.create_task(consume())
    # Only once the handler runs: a caller cancelled before its request is sent runs nothing.
    await asyncio.wait_for(first_read.wait(), 5)
    reader.cancel()  # cancelling the caller's task cancels the stream
    waited = await wait_until(lambda: events, timeout=5, what="handler cancelled")
    assert events == ["cancelled"]
    assert 0.15 <= waited < 1.0


async def test_deadline_stops_the_handler(make_runtime: RuntimeFactory) -> None:
    async def slow(request: Any, ctx: Context) -> AsyncIterator[int]:
        while not ctx.is_stopped():
            yield 1
            await asyncio.sleep(0.01)

    runtime = await make_runtime()
    await serve(runtime, "ns.c.slow", slow)
    client = await runtime.endpoint("ns.c.slow").client()
    await client.wait_for_instances()
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        async for _ in client.round_robin(None, timeout=0.2):
            pass
    assert 0.15 < time.monotonic() - t0 < 1.0


async def test_500_concurrent_streams_share_one_connection(
    make_runtime: RuntimeFactory, plane: str
) -> None:
    """(Over http a request is one POST: those share a pool of connections, not one.)"""

    async def count(request: int, ctx: Context) -> AsyncIterator[int]:
        for i in range(5):
            await asyncio.sleep(0.01)
            yield request * 10 + i

    server = await make_runtime()
    await serve(server, "ns.c.count", count)
    caller = await make_runtime()
    client = await caller.endpoint("ns.c.count").client()
    await client.wait_for_instances()

    async def one(n: int) -> list[int]:
        return [x async for x in client.round_robin(n)]

    results = await asyncio.gather(*(one(n) for n in range(500)))
    assert results == [[n * 10 + i for i in range(5)] for n in range(500)]
    assert len(caller.request_client.connections()) == 1
    assert caller.request_client.open_streams() == 0
    if plane != "http":
        assert len(server._server.connections) == 1  # type: ignore[union-attr]


async def test_shutdown_drains_in_flight_streams_and_refuses_new_ones(
    make_runtime: RuntimeFactory,
) -> None:
    async def slow(request: Any, ctx: Context) -> AsyncIterator[int]:
        for i in range(5):
            await asyncio.sleep(0.05)
            yield i

    server = await make_runtime(drain_timeout=5.0)
    await serve(server, "ns.c.slow", slow)
    caller = await make_runtime()
    client = await caller.endpoint("ns.c.slow").client()
    await client.wait_for_instances()
    in_flight = client.round_robin(None)
    assert await in_flight.__anext__() == 0  # running on the server
    shutdown = asyncio.create_task(server.shutdown())
    plane = server._server
    assert plane is not None
    await wait_until(lambda: plane.draining, 5.0, "the server drains")
    # A request that arrives while draining is refused and never runs.
    stream = await caller.request_client.open_stream(
        server._server.address,
        "ns.c.slow",
        msgspec.Raw(msgspec.msgpack.encode(None)),
        request_id="late",
    )
    with pytest.raises(ShuttingDownError):
        async for _ in stream:
            pass
    assert [x async for x in in_flight] == [1, 2, 3, 4]
    await shutdown
    await wait_until(lambda: not client.instance_ids(), what="instance deregistered")


async def test_unreachable_instance_is_quarantined_and_skipped(
    make_runtime: RuntimeFactory,
) -> None:
    live = await make_runtime()
    await serve(live, "ns.c.echo", echo)
    dead = await make_runtime()
    await serve(dead, "ns.c.echo", echo)
    dead_id = dead.instance_id
    # Close the dead one's listener without deregistering, as a crashed process would.
    dead._server._server.close()  # type: ignore[union-attr]
    for conn in list(dead._server.connections):  # type: ignore[union-attr]
        conn.abort("test")
    caller = await make_runtime()
    client = await caller.endpoint("ns.c.echo").client()
    await wait_until(lambda: len(client.instance_ids()) == 2, what="both instances seen")
    for _ in range(4):
        assert len([x async for x in client.round_robin("x")]) == 3
    assert client.instance_ids() == [live.instance_id]
    with pytest.raises(ConnectError):
        await client.direct("x", dead_id)  # type: ignore[arg-type]


async def test_wait_for_instances_times_out_clearly(make_runtime: RuntimeFactory) -> None:
    runtime = await make_runtime()
    client = await runtime.endpoint("ns.nobody.here").client()
    with pytest.raises(NoInstancesError, match=r"ns\.nobody\.here"):
        await client.wait_for_instances(timeout=0.2)


def test_bad_names_are_refused() -> None:
    runtime = DistributedRuntime(f"mem://{uuid.uuid4().hex}")
    for path in ["a.b", "a.b.c.d", "a..c", "a.b/c.d", "-a.b.c"]:
        with pytest.raises(ValueError):
            runtime.endpoint(path)


async def test_a_handler_that_never_awaits_neither_starves_nor_floods(
    make_runtime: RuntimeFactory,
) -> None:
    pouring = asyncio.Event()

    async def firehose(n: int, ctx: Context) -> AsyncIterator[int]:
        pouring.set()
        for i in range(n):
            yield i

    async def ping(request: Any, ctx: Context) -> str:
        return "pong"

    server = await make_runtime()
    await serve(server, "ns.c.firehose", firehose)
    await serve(server, "ns.c.ping", ping)
    caller = await make_runtime()
    hose = await caller.endpoint("ns.c.firehose").client()
    pinger = await caller.endpoint("ns.c.ping").client()
    await hose.wait_for_instances()
    await pinger.wait_for_instances()
    big = asyncio.create_task(collect(hose.round_robin(200_000)))
    await asyncio.wait_for(pouring.wait(), 5.0)
    t0 = time.monotonic()
    assert await collect(pinger.round_robin(None)) == ["pong"]
    assert not big.done(), "the ping had to wait for the whole firehose"
    assert time.monotonic() - t0 < 0.5
    assert await big == list(range(200_000))


async def test_responses_too_big_or_not_encodable_fail_that_stream_only(
    make_runtime: RuntimeFactory,
) -> None:
    async def bad(kind: str, ctx: Context) -> AsyncIterator[Any]:
        yield "fine"
        yield b"x" * 4096 if kind == "big" else object()

    server = await make_runtime(max_frame_bytes=2048)
    await serve(server, "ns.c.bad", bad)
    caller = await make_runtime(max_frame_bytes=2048)
    client = await caller.endpoint("ns.c.bad").client()
    await client.wait_for_instances()
    for kind, error_type in [("big", "FrameError"), ("odd", "TypeError")]:
        got = []
        with pytest.raises(HandlerError) as info:
            async for item in client.round_robin(kind):
                got.append(item)
        assert got == ["fine"]
        assert info.value.error_type == error_type
    assert await collect(client.round_robin("big"), limit=1) == ["fine"]


async def test_a_huge_handler_error_is_cut_not_lost(make_runtime: RuntimeFactory) -> None:
    async def shouty(request: Any, ctx: Context) -> AsyncIterator[int]:
        yield 1
        raise RuntimeError("x" * 20_000)

    server = await make_runtime(max_frame_bytes=4096)
    await serve(server, "ns.c.shouty", shouty)
    client = await server.endpoint("ns.c.shouty").client()
    await client.wait_for_instances()
    with pytest.raises(HandlerError) as info:
        await collect(client.round_robin(None))
    assert info.value.error_type == "RuntimeError"
    assert "more characters" in info.value.message and len(info.value.message) < 4096


async def test_the_caller_enforces_its_deadline_when_the_server_never_answers(
    make_runtime: RuntimeFactory,
) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads everything, answers nothing
        writer.close()

    mute = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = mute.sockets[0].getsockname()[1]
    runtime = await make_runtime()
    lease = await runtime.discovery.grant_lease(10)
    instance = Instance(
        namespace="ns",
        component="c",
        endpoint="mute",
        instance_id=lease,
        address=f"tcp://127.0.0.1:{port}",
    )
    await runtime.discovery.put(f"/services/ns/c/mute-{lease:x}", instance.to_json(), lease)
    client = await runtime.endpoint("ns.c.mute").client()
    await client.wait_for_instances()
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        await collect(client.round_robin(None, timeout=0.2))
    assert time.monotonic() - t0 < 5  # bounded: the slack past the deadline is 0.5 s
    assert runtime.request_client.open_streams() == 0  # cancelled, not kept
    mute.close()


async def test_an_oversized_request_is_refused_and_leaves_nothing_behind(
    make_runtime: RuntimeFactory,
) -> None:
    server = await make_runtime(max_frame_bytes=2048)
    await serve(server, "ns.c.echo", echo)
    client = await server.endpoint("ns.c.echo").client()
    await client.wait_for_instances()
    assert await collect(client.round_robin("small"), limit=1)
    for _ in range(3):
        with pytest.raises(FrameError, match="over the limit"):
            await client.round_robin("x" * 4096)
    assert server.request_client.open_streams() == 0
    assert len(await collect(client.round_robin("small again"))) == 3


async def test_shutdown_is_bounded_even_if_a_handler_ignores_cancellation(
    make_runtime: RuntimeFactory,
) -> None:
    release = asyncio.Event()

    async def deaf(request: Any, ctx: Context) -> AsyncIterator[int]:
        yield 0
        while not release.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue  # a badly behaved handler

    server = await make_runtime(drain_timeout=0.2)
    await serve(server, "ns.c.deaf", deaf)
    client = await server.endpoint("ns.c.deaf").client()
    await client.wait_for_instances()
    stream = client.round_robin(None)
    assert await stream.__anext__() == 0
    t0 = time.monotonic()
    await server.shutdown()
    assert time.monotonic() - t0 < 5  # drain 0.2 s + cancel wait 1 s, not forever
    release.set()


async def test_a_slow_reader_holds_the_handler_back_to_its_window(
    make_runtime: RuntimeFactory,
) -> None:
    produced: list[int] = []

    async def fast(n: int, ctx: Context) -> AsyncIterator[int]:
        for i in range(n):
            produced.append(i)
            yield i

    server = await make_runtime()
    await serve(server, "ns.c.fast", fast)
    caller = await make_runtime(stream_window=64)
    client = await caller.endpoint("ns.c.fast").client()
    await client.wait_for_instances()
    stream = client.round_robin(5000)
    got = [await stream.__anext__() for _ in range(5)]
    await asyncio.sleep(0.3)  # the reader stalls; the handler must wait, not buffer 5000
    assert 64 <= len(produced) <= 65
    got += await collect(stream)
    assert got == list(range(5000))


async def test_a_draining_instance_is_skipped_without_an_error(
    make_runtime: RuntimeFactory,
) -> None:
    draining, live = await make_runtime(), await make_runtime()
    await serve(draining, "ns.c.echo", echo)
    await serve(live, "ns.c.echo", echo)
    caller = await make_runtime()
    client = await caller.endpoint("ns.c.echo").client()
    await wait_until(lambda: len(client.instance_ids()) == 2, what="both instances seen")
    draining._server.draining = True  # type: ignore[union-attr]  # as during a graceful stop
    served_by = set()
    for i in range(6):
        stream = client.round_robin(i)
        assert len(await collect(stream)) == 3
        served_by.add(stream.instance_id)
    assert served_by == {live.instance_id}
    with pytest.raises(ShuttingDownError):  # direct names the instance: no one else may answer
        await collect(client.direct(0, draining.instance_id))  # type: ignore[arg-type]


async def test_ordered_takes_the_callers_order_and_passes_refusals_on(
    make_runtime: RuntimeFactory,
) -> None:
    first, second = await make_runtime(), await make_runtime()
    await serve(first, "ns.c.echo", echo)
    await serve(second, "ns.c.echo", echo)
    caller = await make_runtime()
    client = await caller.endpoint("ns.c.echo").client()
    await wait_until(lambda: len(client.instance_ids()) == 2, what="both instances seen")
    a, b = first.instance_id, second.instance_id
    assert a is not None and b is not None
    for order in ([a, b], [b, a], [0xDEAD, b]):  # the first live one answers, every time
        for _ in range(3):
            stream = client.ordered(0, order)
            assert len(await collect(stream)) == 3
            assert stream.instance_id == next(i for i in order if i != 0xDEAD)
    first._server.draining = True  # type: ignore[union-attr]  # as during a graceful stop
    stream = client.ordered(0, [a, b])
    assert len(await collect(stream)) == 3
    assert stream.instance_id == b  # a refused it unrun: passed on
    with pytest.raises(NoInstancesError):
        await collect(client.ordered(0, [0xDEAD]))
