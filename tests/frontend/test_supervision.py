"""`kvbaton serve` outlives any one of its processes, under streaming load (real processes, the
mocker): a worker killed with SIGKILL (aggregated with 2 workers; disaggregated, the only prefill
worker and the only decode worker in turn) loses no stream and no token, and a new process in
its slot is registered and answering within `RESTART_S`; a worker that crashes right after it is
ready is restarted each time; a killed frontend is back and answering within `RESTART_S`; a
worker that never becomes ready stops `serve` with its last log lines and a non-zero exit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import DistributedRuntime
from kvbaton.runtime.serve_state import read_states, state_path
from tests.frontend.conftest import (
    Deployment,
    serve_slot,
    start_serve,
    stop_cleanly,
)
from tests.helpers import clean_env, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RESTART_S = 15.0  # from a kill to the new process registered and answering, at most
# About 30 ms a token (speedup 0.2): a 100-token stream lasts about 3 s.
MOCKER = (
    "--engine", "mocker", "--block-size", "16", "--num-kv-blocks", "1024",
    "--max-model-len", "1024", "--speedup-ratio", "0.2",
)  # fmt: skip
TOKENS = 100
STREAMS = 16
TRICKLE_EVERY_S = 0.1  # new streams while the victim dies and comes back


@dataclass
class StreamResult:
    workers: list[int]  # the instances that served it (x-kvbaton-worker)
    chunks: int  # chunks with text
    completion_tokens: int
    finish_reason: str | None


async def one_stream(
    http: httpx.AsyncClient, model: str, prompt: list[int], started: asyncio.Event | None = None
) -> StreamResult:
    """A streamed completion of TOKENS tokens; `started` is set once 3 chunks arrived."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    result = StreamResult([], 0, -1, None)
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        header = response.headers.get("x-kvbaton-worker", "")
        result.workers = [int(w, 16) for w in header.split(",") if w]
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                result.chunks += bool(choice["text"])
                result.finish_reason = choice["finish_reason"] or result.finish_reason
            if chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
            if started is not None and result.chunks >= 3:
                started.set()
    return result


def prompt(i: int) -> list[int]:
    return [(i * 7 + j * 13) % 150 + 20 for j in range(40 + i % 30)]


async def answering(runtime: DistributedRuntime, component: str, pid: int) -> bool:
    """The process `pid` is registered under `component` and answers its load_metrics."""
    client = await runtime.endpoint(f"kvbaton.{component}.load_metrics").client(
        response_type=WorkerLoad
    )
    try:
        for instance in client.instances():
            if instance.pid == pid:
                with contextlib.suppress(Exception):
                    await anext(client.direct(None, instance.instance_id, timeout=2))
                    return True
        return False
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def serving(chat_model: Path, tmp_path: Path, *extra: str) -> AsyncIterator[Deployment]:
    deployment = await asyncio.to_thread(
        start_serve, chat_model, tmp_path / "discovery", *MOCKER, *extra
    )
    try:
        yield deployment
    finally:
        await asyncio.to_thread(stop_cleanly, deployment)


CASES = {
    # slot killed: (serve's flags, the victim's component)
    "agg-worker": (("--workers", "2"), "worker-0", "backend"),
    "disagg-prefill": (("--mode", "disagg"), "prefill-0", "prefill"),
    "disagg-decode": (("--mode", "disagg"), "decode-0", "backend"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_worker_killed_under_load_loses_no_token_and_is_back_within_15_s(
    case: str, chat_model: Path, tmp_path: Path
) -> None:
    flags, slot, component = CASES[case]
    async with (
        serving(chat_model, tmp_path, *flags) as deployment,
        httpx.AsyncClient(base_url=deployment.url, timeout=120) as http,
        DistributedRuntime(deployment.discovery) as runtime,
    ):
        victim = int(serve_slot(deployment, slot)["pid"])
        victim_instance = await instance_of(runtime, component, victim)
        events = [asyncio.Event() for _ in range(STREAMS)]
        streams = [
            asyncio.create_task(one_stream(http, deployment.model, prompt(i), events[i]))
            for i in range(STREAMS)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)

        async def trickle() -> None:  # requests keep arriving while the victim is away
            for i in range(STREAMS, 1000):
                streams.append(asyncio.create_task(one_stream(http, deployment.model, prompt(i))))
                await asyncio.sleep(TRICKLE_EVERY_S)

        arriving = asyncio.create_task(trickle())
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        await wait_until(
            lambda: int(serve_slot(deployment, slot)["pid"]) != victim,
            timeout=RESTART_S,
            what="a new process",
        )
        new = int(serve_slot(deployment, slot)["pid"])
        while not await answering(runtime, component, new):
            assert time.monotonic() - killed_at < RESTART_S, f"{slot} not back in {RESTART_S} s"
            await asyncio.sleep(0.1)
        arriving.cancel()
        results = await asyncio.gather(*streams)
        assert deployment.proc.poll() is None
        assert serve_slot(deployment, slot)["restarts"] == 1
    assert len(results) > STREAMS  # some arrived while the victim was away
    for result in results:
        assert (result.completion_tokens, result.finish_reason) == (TOKENS, "length"), result
    if slot != "decode-0":  # (the only decode worker decodes every stream)
        # The victim had streams in flight: decoding, or prefilled there and decoding on.
        assert any(victim_instance in r.workers for r in results[:STREAMS])


async def instance_of(runtime: DistributedRuntime, component: str, pid: int) -> int:
    client = await runtime.endpoint(f"kvbaton.{component}.generate").client()
    try:
        await client.wait_for_instances(30)
        return next(i.instance_id for i in client.instances() if i.pid == pid)
    finally:
        await client.close()


async def test_a_worker_that_crashes_right_after_it_is_ready_is_restarted_each_time(
    chat_model: Path, tmp_path: Path
) -> None:
    async with (
        serving(chat_model, tmp_path) as deployment,
        DistributedRuntime(deployment.discovery) as runtime,
    ):
        for crash in range(1, 4):
            victim = int(serve_slot(deployment, "worker-0")["pid"])
            await wait_until(
                lambda v=victim: ready_as(deployment, "worker-0", v),
                timeout=RESTART_S,
                what=f"worker-0 ready ({crash})",
            )
            os.kill(victim, signal.SIGKILL)  # as soon as serve counts it ready
            await wait_until(
                lambda v=victim: int(serve_slot(deployment, "worker-0")["pid"]) != v,
                timeout=RESTART_S * crash,  # the backoff doubles: 1, 2, 4 s
                what=f"restart {crash}",
            )
            assert serve_slot(deployment, "worker-0")["restarts"] == crash
        new = int(serve_slot(deployment, "worker-0")["pid"])
        await wait_until(
            lambda: ready_as(deployment, "worker-0", new),
            timeout=RESTART_S * 4,
        )
        assert await answering(runtime, "backend", new)


async def test_a_killed_frontend_is_back_and_answering_within_15_s(
    chat_model: Path, tmp_path: Path
) -> None:
    async with (
        serving(chat_model, tmp_path) as deployment,
        httpx.AsyncClient(base_url=deployment.url, timeout=30) as http,
    ):
        body = {"model": deployment.model, "prompt": "Hi", "max_tokens": 3}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        os.kill(int(serve_slot(deployment, "frontend")["pid"]), signal.SIGKILL)
        killed_at = time.monotonic()

        async def answers() -> bool:
            with contextlib.suppress(httpx.TransportError):
                return (await http.post("/v1/completions", json=body)).status_code == 200
            return False

        while not await answers():  # at the same address
            assert time.monotonic() - killed_at < RESTART_S, "the frontend is not back"
            await asyncio.sleep(0.1)
        assert serve_slot(deployment, "frontend")["restarts"] == 1


async def test_a_worker_that_never_becomes_ready_stops_serve_with_its_last_lines(
    chat_model: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken-model"
    shutil.copytree(chat_model, broken)
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    done = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable, "-m", "kvbaton", "serve", "--model", str(broken), "--http-port", "0",
            "--discovery", f"file://{tmp_path / 'discovery'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "worker-0 (pid" in done.stderr
    assert "failed its first start before it was ready (code 2)" in done.stderr  # bad input
    tail = done.stderr[done.stderr.index("its last log lines:") :]
    assert "no-such-architecture" in tail, tail  # the worker's own error, among its last lines
    assert "ready at" not in done.stderr


def ready_as(deployment: Deployment, slot: str, pid: int) -> bool:
    """serve counts `slot` ready, with process `pid` in it."""
    found = serve_slot(deployment, slot)
    return bool(found["state"] == "ready" and found["pid"] == pid)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_serve_killed_with_sigkill_takes_its_children_along(
    chat_model: Path, tmp_path: Path
) -> None:
    deployment = await asyncio.to_thread(
        start_serve, chat_model, tmp_path / "discovery", *MOCKER, "--workers", "2"
    )
    children = [int(serve_slot(deployment, s)["pid"]) for s in ("frontend", "worker-0", "worker-1")]
    assert all(alive(pid) for pid in children)
    deployment.proc.kill()  # no chance to stop them itself
    deployment.proc.wait(30)
    state_file = state_path(deployment.proc.pid)
    assert state_file.exists()  # left behind: SIGKILL gave serve no chance to remove it
    assert read_states(deployment.discovery) == [] and not state_file.exists()  # the reader did
    try:
        await wait_until(lambda: not any(alive(pid) for pid in children), 60, "children gone")
    finally:
        for pid in children:  # ours to clean up if they outlived serve
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
