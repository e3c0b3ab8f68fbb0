"""Health canaries with real processes: a worker whose engine stops answering (SIGSTOP) fails
its canary while idle and is not routed to, so no request waits on it; once it answers again
(SIGCONT) it passes and is routed to again."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest

from tests.conftest import WorkerFactory
from tests.frontend.conftest import Deployment
from tests.frontend.fleet import poll, ready, running_frontend
from tests.helpers import scraped

pytestmark = pytest.mark.integration

NS = "t"


async def served_by(http: httpx.AsyncClient, model: str, n: int) -> list[str]:
    """The worker that served each of `n` concurrent requests (`x-kvbaton-worker`)."""

    async def one(i: int) -> str:
        body = {"model": model, "prompt": [20 + i, 21, 22], "max_tokens": 2}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.headers["x-kvbaton-worker"]

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def test_a_hung_worker_fails_its_canary_and_is_passed_over_until_it_passes(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path
) -> None:
    flags = ("--canary-period", "1", "--canary-timeout", "1", "--first-output-timeout", "60")
    async with running_frontend(tmp_path, *flags) as frontend:
        workers = [
            spawn_worker(
                *("--model", str(chat_model), "--block-size", "16", "--num-kv-blocks", "256"),
                engine="mocker",
                lease_ttl=30.0,  # a stopped worker keeps its lease: only the canary finds it
                namespace=NS,
            )
            for _ in range(2)
        ]
        await ready(frontend, chat_model, prefill=0, serving=2)
        async with httpx.AsyncClient(base_url=frontend.url, timeout=30) as http:
            both = set(await served_by(http, chat_model.name, 20))
            assert len(both) == 2  # both serve while healthy

            workers[0].send_signal(signal.SIGSTOP)
            try:
                await poll(lambda: unhealthy(frontend, 1), 30, "no canary failed")
                # Every request goes to the other worker, at once: none waits on the hung one
                # (its first output would take --first-output-timeout, 60 s).
                async with asyncio.timeout(20):
                    after = set(await served_by(http, chat_model.name, 20))
                assert len(after) == 1
            finally:
                workers[0].send_signal(signal.SIGCONT)
            await poll(lambda: unhealthy(frontend, 0), 30, "no canary passed")
            assert set(await served_by(http, chat_model.name, 20)) == both


async def unhealthy(frontend: Deployment, count: int) -> bool:
    """Whether `count` workers are unhealthy, on the frontend's /metrics and in its
    /v1/cluster (the two agree)."""
    async with httpx.AsyncClient(base_url=frontend.url) as http:
        rows = (await http.get("/v1/cluster")).json()["workers"]
    shown = sum(not row["healthy"] for row in rows)
    name = "kvbaton_frontend_unhealthy_workers"
    exported = await asyncio.to_thread(scraped, f"{frontend.url}/metrics", name)
    return shown == exported == count
