"""What only the http request plane does: a POST per stream on pooled keep-alive connections,
a caller that goes away seen as a disconnect, refusals of bad bodies as plain HTTP errors, a
server that dies mid-stream seen as a broken stream. (The runtime's behaviour on every plane is
tests/runtime/test_runtime.py's.)"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from kvbaton.protocols.frames import Data, End, Request
from kvbaton.runtime import (
    ConnectError,
    Context,
    DistributedRuntime,
    FrameError,
    StreamBrokenError,
)
from kvbaton.runtime.request_plane.framing import HEADER, FrameDecoder, encode_frame, encode_payload
from kvbaton.runtime.request_plane.http_server import HttpRequestServer
from kvbaton.runtime.request_plane.http_wire import PATH
from tests.conftest import WorkerFactory
from tests.helpers import collect, wait_until

LIMIT = 1 << 20

RuntimeFactory = Callable[..., DistributedRuntime]


@pytest.fixture
async def make_runtime() -> AsyncIterator[RuntimeFactory]:
    discovery = f"mem://{uuid.uuid4().hex}"
    runtimes: list[DistributedRuntime] = []

    def make(**overrides: Any) -> DistributedRuntime:
        runtime = DistributedRuntime(discovery, request_plane="http", lease_ttl=2.0, **overrides)
        runtimes.append(runtime)
        return runtime

    yield make
    for runtime in runtimes:
        await runtime.shutdown()


async def serve(runtime: DistributedRuntime, path: str, handler: Any) -> HttpRequestServer:
    task = asyncio.create_task(runtime.endpoint(path).serve_endpoint(handler))
    while runtime._server is None or path not in runtime._server.routes:
        await asyncio.sleep(0.001)
        if task.done():
            task.result()
    assert isinstance(runtime._server, HttpRequestServer)
    assert runtime._server.address.startswith("http://")
    return runtime._server


async def counting(request: dict[str, Any], ctx: Context) -> AsyncIterator[int]:
    for i in range(int(request.get("n", 3))):
        if request.get("delay"):
            await asyncio.sleep(request["delay"])
        yield i


def post_body(endpoint: str, payload: Any = None, window: int = 0) -> bytes:
    return encode_frame(Request(1, endpoint, "raw", encode_payload(payload), None, window), LIMIT)


@pytest.mark.unit
async def test_a_caller_that_goes_away_mid_stream_stops_the_handler(
    make_runtime: RuntimeFactory,
) -> None:
    stopped_at: list[float] = []

    async def endless(request: Any, ctx: Context) -> AsyncIterator[int]:
        i = 0
        try:
            while not ctx.is_stopped():
                yield i
                i += 1
                await asyncio.sleep(0.002)
        finally:
            stopped_at.append(time.monotonic())

    server = await serve(make_runtime(), "ns.c.endless", endless)
    async with (
        httpx.AsyncClient() as http,
        http.stream("POST", server.address + PATH, content=post_body("ns.c.endless")) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/x-kvbaton-frames"
        decoder = FrameDecoder(LIMIT)
        got: list[Any] = []
        async for chunk in response.aiter_raw():
            got += [p for f in decoder.feed(chunk) if isinstance(f, Data) for p in f.payloads]
            if len(got) >= 5:
                break
        left_at = time.monotonic()
    # Leaving the block closed the response unread: the server sees a disconnect.
    await wait_until(lambda: stopped_at, 2.0, "handler stopped")
    assert stopped_at[0] - left_at < 0.1
    await wait_until(lambda: not server.connections and not server.tasks, 2.0, "nothing left")


@pytest.mark.unit
async def test_a_caller_that_goes_away_before_any_response_stops_the_handler(
    make_runtime: RuntimeFactory,
) -> None:
    events: list[str] = []

    async def slow(request: Any, ctx: Context) -> AsyncIterator[int]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("cancelled" if ctx.is_stopped() else "cancelled unstopped")
            raise
        yield 1

    server = await serve(make_runtime(cancel_grace=0.05), "ns.c.slow", slow)
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", server.address + PATH, content=post_body("ns.c.slow")) as r:
            assert r.status_code == 200  # the headers come at once: the request was taken
            await asyncio.sleep(0.05)
        left_at = time.monotonic()
    await wait_until(lambda: events, 2.0, "handler cancelled")
    assert events == ["cancelled"]
    assert time.monotonic() - left_at < 0.5  # the grace (0.05 s) and a little


@pytest.mark.unit
async def test_bad_bodies_get_a_clear_http_error_and_disturb_no_other_stream(
    make_runtime: RuntimeFactory,
) -> None:
    server = await serve(make_runtime(max_frame_bytes=4096), "ns.c.count", counting)
    caller = make_runtime()
    client = await caller.endpoint("ns.c.count").client()
    await client.wait_for_instances()
    long_stream = asyncio.create_task(collect(client.round_robin({"n": 40, "delay": 0.01})))
    url = server.address + PATH
    request = post_body("ns.c.count", {"n": 1})

    async def chunked(*parts: bytes, pause: float = 0.0) -> AsyncIterator[bytes]:
        for i, part in enumerate(parts):
            if i and pause:
                await asyncio.sleep(pause)  # the part before is read on its own
            yield part

    cases: list[tuple[str, Any, int, str]] = [
        ("empty", b"", 400, "must start with a Request frame, not nothing"),
        ("malformed", HEADER.pack(3) + b"abc", 400, "malformed frame"),
        ("truncated", request[:-3], 400, "not a truncated frame"),
        ("not a request", encode_frame(End(1), LIMIT), 400, "not End"),
        ("request then junk", request + HEADER.pack(2) + b"\xc1\xc1", 400, "malformed frame"),
        ("oversized body", b"x" * 100_000, 413, "over the limit of 4096 bytes"),
        ("oversized frame", HEADER.pack(1 << 20) + b"x" * 100, 413, "over the limit"),
        ("oversized, chunked", chunked(HEADER.pack(5000), b"x" * 5000), 413, "over the limit"),
    ]
    async with httpx.AsyncClient() as http:
        for name, content, status, text in cases:
            response = await http.post(url, content=content)
            assert (name, response.status_code) == (name, status)
            assert text in response.text, (name, response.text)
        response = await http.get(url)
        assert response.status_code == 405 and "POST /rpc" in response.text
        response = await http.post(server.address + "/elsewhere", content=request)
        assert response.status_code == 404
        # A bad frame later in a body that already started a stream breaks that response only.
        later_junk = chunked(post_body("ns.c.count", {"n": 10**6}), b"\xff" * 8, pause=0.05)
        with pytest.raises(httpx.HTTPError):
            async with http.stream("POST", url, content=later_junk) as response:
                assert response.status_code == 200
                async for _ in response.aiter_raw():
                    pass
        # The raw client's pooled connection still serves a good request.
        response = await http.post(url, content=request)
        frames = FrameDecoder(LIMIT).feed(response.content)
        assert response.status_code == 200 and isinstance(frames[-1], End)
    assert await long_stream == list(range(40))
    assert await collect(client.round_robin({"n": 2})) == [0, 1]
    await wait_until(lambda: not server.connections and not server.tasks, 2.0, "nothing left")


@pytest.mark.unit
async def test_a_request_over_the_servers_frame_limit_is_refused_unrun(
    make_runtime: RuntimeFactory,
) -> None:
    served: list[Any] = []

    async def record(request: Any, ctx: Context) -> int:
        served.append(request)
        return 1

    await serve(make_runtime(max_frame_bytes=1024), "ns.c.record", record)
    caller = make_runtime()  # a larger limit than the server's: the server refuses
    client = await caller.endpoint("ns.c.record").client()
    await client.wait_for_instances()
    with pytest.raises(FrameError, match="over the limit of 1024 bytes"):
        await collect(client.round_robin("x" * 4000))
    assert served == []
    assert await collect(client.round_robin("small")) == [1]
    assert served == ["small"]
    assert caller.request_client.open_streams() == 0


@pytest.mark.unit
async def test_pooled_connections_are_reused_and_a_closed_idle_one_is_replaced(
    make_runtime: RuntimeFactory,
) -> None:
    server = await serve(make_runtime(), "ns.c.count", counting)
    caller = make_runtime()
    client = await caller.endpoint("ns.c.count").client()
    await client.wait_for_instances()
    for _ in range(20):
        assert await collect(client.round_robin({"n": 2})) == [0, 1]
    assert caller.request_client.connections() == [server.address]
    assert server._uvicorn is not None
    accepted = server._uvicorn.server_state.connections
    assert len(accepted) == 1  # one keep-alive connection carried the 20 calls in turn
    # The server closes its idle connection (as at its keep-alive timeout); the caller sends
    # its next request on it before it can notice, gets no answer, and sends it again on a
    # new connection: nothing had run, so the caller sees nothing of it.
    for protocol in list(accepted):
        protocol.transport.close()  # type: ignore[union-attr]
    assert await collect(client.round_robin({"n": 2})) == [0, 1]
    assert caller.request_client.open_streams() == 0


@pytest.mark.unit
async def test_serves_on_ipv6(make_runtime: RuntimeFactory) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    server = await serve(make_runtime(host="::1"), "ns.c.count", counting)
    assert server.address.startswith("http://[::1]:")
    client = await make_runtime().endpoint("ns.c.count").client()
    await client.wait_for_instances()
    assert await collect(client.round_robin({"n": 3})) == [0, 1, 2]


@pytest.mark.integration
async def test_a_server_killed_mid_stream_is_a_broken_stream_not_a_hang(
    spawn_worker: WorkerFactory, discovery_url: str
) -> None:
    proc = spawn_worker("--request-plane", "http")
    runtime = DistributedRuntime(discovery_url, lease_ttl=2.0)
    try:
        generate = await runtime.endpoint("t.backend.generate").client()
        await generate.wait_for_instances(timeout=30)  # a cold start on a loaded machine
        (instance,) = generate.instances()
        assert instance.address.startswith("http://")
        stream = generate.round_robin({"n": 100_000, "delay": 0.005})
        await stream.__anext__()
        assert runtime.request_client.connections() == [instance.address]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(StreamBrokenError):
            await asyncio.wait_for(collect(stream), 10)
        assert time.monotonic() - t0 < 2
        assert runtime.request_client.connections() == []
        assert runtime.request_client.open_streams() == 0
        with pytest.raises(ConnectError):  # nothing listens: refused, nothing ran
            await generate.direct({"n": 1}, instance.instance_id)
    finally:
        await runtime.shutdown()
