"""Workers and clients coming and going around a real frontend: a client that leaves mid-stream
frees its blocks at the worker, a dead worker gives 503 (no wait for one to come back), a worker
that dies mid-stream gives an error event, `kvbaton serve` stops everything on SIGINT and
restarts a worker that died."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import DistributedRuntime
from tests.conftest import WorkerFactory
from tests.frontend.conftest import (
    Deployment,
    kvbaton_status,
    serve_slot,
    start_frontend,
    start_serve,
    stop_cleanly,
    stop_serve,
    wait_for_health,
)
from tests.frontend.fleet import poll
from tests.helpers import wait_until
from tests.tiny_models import build_chat_model

pytestmark = pytest.mark.integration

STARTUP_S = 120.0


async def load(runtime: DistributedRuntime, namespace: str = "kvbaton") -> WorkerLoad:
    client = await runtime.endpoint(f"{namespace}.backend.load_metrics").client(
        response_type=WorkerLoad
    )
    try:
        await client.wait_for_instances(STARTUP_S)
        loads: list[WorkerLoad] = [x async for x in client.round_robin(None)]
        return loads[0]
    finally:
        await client.close()


LONG_ANSWER = 4000  # tokens: seconds of decoding, where the client's close takes milliseconds


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A model with room for `LONG_ANSWER` tokens: with 200, the tiny model sometimes finished
    before the client's close reached the worker.

    - No canaries: the test counts the worker's requests and blocks exactly, and a canary sent
      to the idle worker is a request of its own (it failed the first assert once)."""
    model = build_chat_model(
        tmp_path_factory.mktemp("models") / "tiny-chat-long", max_positions=LONG_ANSWER + 256
    )
    deployment = start_serve(
        model,
        tmp_path_factory.mktemp("discovery"),
        "--num-threads",
        "1",
        "--num-kv-blocks",
        "1024",  # room for the whole answer (the last value given wins)
        "--canary-period",
        "0",
    )
    yield deployment
    stop_cleanly(deployment)


async def test_client_leaving_mid_stream_frees_its_blocks(served: Deployment) -> None:
    async with DistributedRuntime(served.discovery) as runtime:
        before = await load(runtime)
        assert before.kv_blocks_used == 0 and before.running == 0
        async with (
            httpx.AsyncClient(base_url=served.url) as http,
            http.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": served.model,
                    "messages": [{"role": "user", "content": "Tell me a long story."}],
                    "max_tokens": LONG_ANSWER,
                    "stream": True,
                    "ignore_eos": True,
                },
                headers={"x-request-id": "leaves-early"},
            ) as response,
        ):
            assert response.status_code == 200
            lines = response.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass
            during = await load(runtime)
        # The connection is closed here, long before LONG_ANSWER tokens.

        async def ended() -> bool:
            return (await load(runtime)).requests_ended != before.requests_ended

        await poll(ended, 30.0, "the worker ending the request")
        after = await load(runtime)
        assert after.requests_ended == {
            **before.requests_ended,
            "cancelled": before.requests_ended.get("cancelled", 0) + 1,
        }  # cut short by the client, not run to its length
        # The prompt's full blocks stay cached (free, reusable) until cleared.
        clear = await runtime.endpoint("kvbaton.backend.clear_kv_blocks").client()
        await clear.wait_for_instances(STARTUP_S)
        first = [x async for x in clear.round_robin(None)]
        again = [x async for x in clear.round_robin(None)]
        await clear.close()
    assert first[0]["cleared"] > 0 and again[0]["cleared"] == 0
    assert during.kv_blocks_used > 0
    assert (after.kv_blocks_used, after.running, after.waiting) == (0, 0, 0)
    assert after.kv_blocks_free == before.kv_blocks_free


async def test_dead_worker_gives_503_and_mid_stream_death_an_error_event(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path
) -> None:
    frontend = await asyncio.to_thread(
        start_frontend, tmp_path / "discovery", "t", "--worker-wait-timeout", "0"
    )
    try:
        worker = spawn_worker(
            "--model", str(chat_model), "--dtype", "float32", engine="torch", lease_ttl=30.0
        )
        await asyncio.to_thread(wait_for_health, frontend.url, chat_model.name, 1)
        client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="none", max_retries=0)
        async with client, httpx.AsyncClient(base_url=frontend.url) as http:
            stream = await client.completions.create(
                model=chat_model.name,
                prompt="Once upon a time",
                max_tokens=200,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            with pytest.raises(openai.APIError, match="worker"):
                async for _ in stream:
                    if worker.poll() is None:
                        worker.send_signal(signal.SIGKILL)
                        await asyncio.to_thread(worker.wait)
            # The card lives on with the lease (30 s), but the instance is gone: 503, at once
            # (waiting for a worker to come back is off).
            r = await http.post("/v1/completions", json={"model": chat_model.name, "prompt": "Hi"})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "no_workers"
    finally:
        await asyncio.to_thread(stop_cleanly, frontend)


async def test_serve_with_two_workers_dumps_their_stacks_and_stops_them_all_on_sigint(
    chat_model: Path, tmp_path: Path
) -> None:
    deployment = await asyncio.to_thread(
        start_serve, chat_model, tmp_path / "discovery", "--workers", "2"
    )
    try:
        await asyncio.to_thread(wait_for_health, deployment.url, deployment.model, 2)
        deployment.proc.send_signal(signal.SIGUSR1)  # every process's stacks, to the log
        processes = ("", "[frontend] ", "[worker-0] ", "[worker-1] ")  # serve, its children
        stack = ("Thread 0x", "Current thread 0x")  # each thread's stack starts so

        async def dumped() -> bool:
            lines = deployment.log_text().splitlines()
            return all(
                any(line.startswith(p + s) for line in lines for s in stack) for p in processes
            )

        await poll(dumped, 30, "not every process wrote its stacks")
        await asyncio.to_thread(wait_for_health, deployment.url, deployment.model, 2)  # served on
    finally:
        await asyncio.to_thread(stop_cleanly, deployment)  # (exit 0: each one stopped on its own)
    status = await asyncio.to_thread(kvbaton_status, deployment.discovery)
    assert status.splitlines()[1] == "no instances"


async def test_serve_on_a_discovery_of_its_own_names_it_and_removes_it(chat_model: Path) -> None:
    """With no --discovery, `kvbaton serve` keeps its processes apart from every other
    deployment's, and says how `kvbaton status` finds them."""
    deployment = await asyncio.to_thread(start_serve, chat_model, None, "--engine", "mocker")
    own = deployment.discovery
    try:
        assert own.startswith("file://") and "kvbaton-serve-" in own, own
        await asyncio.to_thread(wait_for_health, deployment.url, deployment.model, 1)
        status = await asyncio.to_thread(kvbaton_status, own)
        rows = [line.split()[:3] for line in status.splitlines()[2:]]
        assert ["kvbaton", "backend", "generate"] in rows, status
    finally:
        await asyncio.to_thread(stop_cleanly, deployment)
    assert not await asyncio.to_thread(os.path.exists, own.removeprefix("file://"))


async def test_serve_restarts_a_worker_that_dies(chat_model: Path, tmp_path: Path) -> None:
    deployment = await asyncio.to_thread(start_serve, chat_model, tmp_path / "discovery")
    try:
        async with DistributedRuntime(deployment.discovery) as runtime:
            client = await runtime.endpoint("kvbaton.backend.generate").client()
            await client.wait_for_instances(30)
            (instance,) = client.instances()
            os.kill(instance.pid, signal.SIGKILL)  # the worker, a child of `serve`
            await wait_until(
                lambda: any(i.pid != instance.pid for i in client.instances()),
                timeout=STARTUP_S,
                what="a new worker",
            )
            await client.close()
        assert deployment.proc.poll() is None  # serve lives on, and so does its frontend
        await wait_until(
            lambda: serve_slot(deployment, "worker-0")["state"] == "ready",
            timeout=STARTUP_S,
            what="serve counting the new worker ready",
        )
        async with httpx.AsyncClient(base_url=deployment.url, timeout=STARTUP_S) as http:
            body = {"model": deployment.model, "prompt": "Hi", "max_tokens": 2}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
        status = await asyncio.to_thread(kvbaton_status, deployment.discovery)
        rows = [line.split() for line in status.splitlines()]
        (row,) = [r for r in rows if r and r[0] == "worker-0"]
        state, pid, restarts = row[1:4]
        assert (state, restarts, " ".join(row[4:])) == ("ready", "1", "signal SIGKILL"), row
        assert int(pid) not in (instance.pid, deployment.proc.pid)
    finally:
        await asyncio.to_thread(stop_serve, deployment.proc)
