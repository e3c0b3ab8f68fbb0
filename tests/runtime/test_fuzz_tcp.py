"""The tcp request plane under hostile bytes: random bytes and mutated valid frames
(hypothesis), each on a connection of its own, against a server that meanwhile streams to a
well-behaved client. The server never hangs on them nor crashes; the other client's stream goes
on undisturbed and new calls are answered."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbaton.protocols.frames import Cancel, Credit, Request
from kvbaton.runtime import Client, Context, DistributedRuntime
from kvbaton.runtime.request_plane.framing import encode_frame, encode_payload

pytestmark = pytest.mark.integration

LIMIT = 1 << 20
TICKS = 10**6  # the well-behaved stream: a number every 10 ms, for longer than the test


async def ticking(request: dict[str, Any], ctx: Context) -> AsyncIterator[int]:
    for i in range(int(request["n"])):
        await asyncio.sleep(request.get("delay", 0))
        yield i


@dataclass
class Plane:
    host: str
    port: int
    client: Client
    seen: list[int] = field(default_factory=list)  # the well-behaved stream's items
    stream: asyncio.Task[None] | None = None


@pytest.fixture
async def plane() -> AsyncIterator[Plane]:
    discovery = f"mem://{uuid.uuid4().hex}"
    async with (
        DistributedRuntime(discovery, request_plane="tcp") as server,
        DistributedRuntime(discovery, request_plane="tcp") as caller,
    ):
        serving = asyncio.create_task(server.endpoint("t.c.tick").serve_endpoint(ticking))
        client = await caller.endpoint("t.c.tick").client()
        await client.wait_for_instances(10)
        assert server._server is not None
        host, port = server._server.address.removeprefix("tcp://").rsplit(":", 1)
        fixture = Plane(host, int(port), client)

        async def stream() -> None:
            async for item in client.round_robin({"n": TICKS, "delay": 0.01}):
                fixture.seen.append(item)

        fixture.stream = asyncio.create_task(stream())
        yield fixture
        # It streamed through every example, every item in order, and streams still.
        assert not fixture.stream.done(), fixture.stream
        assert len(fixture.seen) > 100 and fixture.seen == list(range(len(fixture.seen)))
        fixture.stream.cancel()
        serving.cancel()
        await client.close()


def valid_frames() -> list[bytes]:
    payload = encode_payload({"n": 2})
    return [
        encode_frame(Request(1, "t.c.tick", "fuzz", payload, None, 0), LIMIT),
        encode_frame(Request(2, "t.c.tick", "fuzz", payload, 1.0, 1), LIMIT),
        encode_frame(Credit(1, 4), LIMIT),
        encode_frame(Cancel(1), LIMIT),
    ]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid frame (or two) with bytes flipped, cut, inserted or its length header changed."""
    frames = draw(st.lists(st.sampled_from(valid_frames()), min_size=1, max_size=2))
    data = bytearray(b"".join(frames))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "header"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            data[0:4] = draw(st.sampled_from([0, 1, 7, 1 << 16, LIMIT + 1, 0xFFFFFFFF])).to_bytes(
                4, "big"
            )
    return bytes(data)


async def throw(plane: Plane, data: bytes) -> None:
    """Send `data` on a fresh connection, then read what comes back until the server closes it
    or a short while passes (a truncated frame leaves it waiting for more: that is no hang of
    the server's, which serves others meanwhile)."""
    reader, writer = await asyncio.open_connection(plane.host, plane.port)
    try:
        writer.write(data)
        await writer.drain()
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(0.1):
                while await reader.read(65536):
                    pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.one_of(st.binary(max_size=256), mutated()))
async def test_random_and_mutated_frames_disturb_no_other_client(plane: Plane, data: bytes) -> None:
    await throw(plane, data)
    assert plane.stream is not None and not plane.stream.done()  # the other stream goes on
    answer = [x async for x in plane.client.round_robin({"n": 3}, timeout=5)]
    assert answer == [0, 1, 2]
