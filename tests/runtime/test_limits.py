"""Limits that protect a serving process, on the tcp request plane: the streams one connection
may have open at once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvbaton.runtime import Context, DistributedRuntime, StreamLimitError

pytestmark = pytest.mark.integration


async def waiting(request: Any, ctx: Context) -> AsyncIterator[str]:
    yield "started"
    await asyncio.sleep(3600)


async def test_streams_past_the_connection_limit_are_refused_unrun() -> None:
    discovery = f"mem://{uuid.uuid4().hex}"
    async with (
        DistributedRuntime(discovery, max_streams_per_connection=2) as server,
        DistributedRuntime(discovery) as caller,
    ):
        serving = asyncio.create_task(server.endpoint("t.c.wait").serve_endpoint(waiting))
        client = await caller.endpoint("t.c.wait").client()
        (instance,) = await client.wait_for_instances(10)
        open_streams = [client.direct(None, instance) for _ in range(2)]
        for stream in open_streams:
            assert await anext(stream) == "started"
        with pytest.raises(StreamLimitError, match="2 streams are open on this connection"):
            await anext(client.direct(None, instance))
        await open_streams[0].aclose()
        # Its slot frees once its handler has stopped (within the cancel grace, 0.5 s).
        async with asyncio.timeout(10):
            while True:
                third = client.direct(None, instance)
                try:
                    assert await anext(third) == "started"
                    break
                except StreamLimitError:
                    await asyncio.sleep(0.1)
        for stream in (open_streams[1], third):
            await stream.aclose()
        await client.close()
        serving.cancel()
