"""The system server (`--system-port`): /live from the start, /health ready only while the
process serves an endpoint and is not shutting down, /metrics."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvbaton.runtime import Context, DistributedRuntime
from kvbaton.runtime.http_embed import listen
from tests.conftest import WorkerFactory
from tests.helpers import wait_until
from tests.servers import free_port

pytestmark = pytest.mark.unit


@pytest.fixture
def discovery_url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'discovery'}"


async def slow(request: Any, context: Context) -> AsyncIterator[int]:
    for i in range(20):
        await asyncio.sleep(0.05)
        yield i


async def test_health_follows_the_runtime_from_starting_to_stopping() -> None:
    runtime = DistributedRuntime(f"mem://{uuid.uuid4().hex}", system_port=0, drain_timeout=5.0)
    url = runtime.start_system_server()
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as http:
        assert (await http.get("/live")).status_code == 200
        starting = await http.get("/health")
        assert (starting.status_code, starting.json()["status"]) == (503, "starting")

        serving = asyncio.create_task(runtime.endpoint("ns.c.slow").serve_endpoint(slow))
        await wait_until(lambda: runtime.health()[0], 5.0, "serving")
        ready = await http.get("/health")
        assert ready.status_code == 200
        assert ready.json() == {"status": "ready", "endpoints": ["ns.c.slow"]}
        metrics = await http.get("/metrics")
        assert metrics.status_code == 200 and "process_" in metrics.text
        assert (await http.get("/nope")).status_code == 404

        caller = DistributedRuntime(runtime.discovery)
        client = await caller.endpoint("ns.c.slow").client()
        await client.wait_for_instances()
        stream = client.round_robin(None)
        assert await stream.__anext__() == 0
        shutdown = asyncio.create_task(runtime.shutdown())
        async with asyncio.timeout(5):  # until shutdown starts, draining the stream
            while (stopping := await http.get("/health")).status_code == 200:
                pass
        assert (stopping.status_code, stopping.json()["status"]) == (503, "stopping")
        assert (await http.get("/live")).status_code == 200
        assert [i async for i in stream] == list(range(1, 20))
        await shutdown
        await serving
        with pytest.raises(httpx.ConnectError):  # stopped with the runtime
            await http.get("/live")


async def test_a_worker_serves_its_health_on_the_system_port(
    spawn_worker: WorkerFactory,
) -> None:
    port = free_port()
    proc = spawn_worker("--system-port", str(port))
    deadline = time.monotonic() + 30
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=2.0) as http:
        while True:
            try:
                health = await http.get("/health")
                if health.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "no healthy worker"
            await asyncio.sleep(0.1)
        assert health.json()["status"] == "ready"
        assert any(e.endswith(".generate") for e in health.json()["endpoints"])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0


def test_a_port_in_use_is_named_in_the_error() -> None:
    """The frontend, the system server and the http plane all listen through `listen`."""
    taken = listen("127.0.0.1", 0)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: ") as error:
            listen("127.0.0.1", port)
        assert error.value.errno is not None
    finally:
        taken.close()
