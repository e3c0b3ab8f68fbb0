"""A test's own `kvbaton frontend` and mocker workers on its discovery directory, and bounded
waits on what they report (their loads, the frontend's health)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai

from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import DistributedRuntime
from tests.conftest import WorkerFactory
from tests.frontend.conftest import (
    Deployment,
    start_frontend,
    stop_cleanly,
    wait_for_health,
    worker_load,
)

NS = "t"  # the namespace of every process here
MAX_LEN = 4096  # the mocker workers' context


def mocker(spawn: WorkerFactory, model: Path, role: str, *extra: str) -> subprocess.Popen[bytes]:
    return spawn(
        "--model",
        str(model),
        "--role",
        role,
        "--block-size",
        "16",
        "--num-kv-blocks",
        "512",
        "--max-model-len",
        str(MAX_LEN),
        *extra,
        engine="mocker",
        lease_ttl=30.0,
        namespace=NS,
    )


async def load(runtime: DistributedRuntime, component: str) -> WorkerLoad:
    return await worker_load(runtime, f"{NS}.{component}.load_metrics")


async def poll(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.1)


async def all_free(runtime: DistributedRuntime, *components: str) -> None:
    """Until every given worker reports no block in use (30 s at most)."""
    used: dict[str, int] = {}

    async def free() -> bool:
        for component in components:
            used[component] = (await load(runtime, component)).kv_blocks_used
        return not any(used.values())

    await poll(free, 30, f"blocks still in use: {used}")


@contextlib.asynccontextmanager
async def running_frontend(tmp_path: Path, *flags: str) -> AsyncIterator[Deployment]:
    """`kvbaton frontend` on the test's discovery directory, stopped (cleanly) at the end."""
    deployment = await asyncio.to_thread(start_frontend, tmp_path / "discovery", NS, *flags)
    try:
        yield deployment
    finally:
        await asyncio.to_thread(stop_cleanly, deployment)


async def ready(frontend: Deployment, model: Path, prefill: int = 1, serving: int = 1) -> None:
    """Until the frontend serves the model on `serving` workers (aggregated or decode) and sees
    `prefill` prefill workers of it."""
    await asyncio.to_thread(wait_for_health, frontend.url, model.name, serving)
    if prefill:
        async with httpx.AsyncClient(base_url=frontend.url) as http:

            async def all_prefill() -> bool:
                ids = (await http.get("/health")).json()["prefill"].get(model.name, [])
                return len(ids) == prefill

            await poll(all_prefill, 60, f"not {prefill} prefill worker(s)")


async def model_row(frontend: Deployment) -> dict[str, Any]:
    """The frontend's one served model in its `GET /v1/cluster`."""
    async with httpx.AsyncClient() as http:
        (model,) = (await http.get(f"{frontend.url}/v1/cluster")).json()["models"]
    return model  # type: ignore[no-any-return]


def client_of(frontend: Deployment) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="none", max_retries=0)
