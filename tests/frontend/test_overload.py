"""Overload: 10x what the deployment can serve, for 30 s, against a frontend and one mocker
worker (real processes). The excess is refused by the frontend (503, Retry-After) without
reaching the worker, whose queue stays near the threshold instead of growing without bound;
the requests taken are served, memory stays bounded and nothing crashes. And the busy
thresholds change at run time. (How fast the excess is refused, and what the served requests
wait: `bench/overload.py`, beside the same load without shedding.)"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx
import pytest

from kvbaton.cli.frontend_flags import busy_thresholds
from kvbaton.cli.main import build_parser
from kvbaton.runtime import DistributedRuntime
from tests.conftest import WorkerFactory
from tests.frontend.fleet import all_free, load, poll, ready, running_frontend

pytestmark = pytest.mark.integration

NS = "t"
PROMPT_TOKENS = 200
# One prompt per step at 1 ms a prompt token: about 5 requests/s at most.
CAPACITY_RPS = 5.0
OVERLOAD = 10
SECONDS = 30.0
BUSY_PREFILL_TOKENS = 5 * PROMPT_TOKENS
SAMPLE_S = 0.5


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.slow
async def test_ten_times_the_capacity_is_shed_and_the_rest_served(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path
) -> None:
    flags = ("--busy-prefill-tokens", str(BUSY_PREFILL_TOKENS), "--busy-kv-usage", "0.9")
    async with running_frontend(tmp_path, *flags) as frontend:
        worker = spawn_worker(
            *("--model", str(chat_model), "--block-size", "16", "--num-kv-blocks", "1024"),
            *("--mocker-prefill", "0,1,0", "--max-num-batched-tokens", str(PROMPT_TOKENS)),
            engine="mocker",
            lease_ttl=3.0,
            namespace=NS,
        )
        await ready(frontend, chat_model, prefill=0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
        async with (
            httpx.AsyncClient(base_url=frontend.url, timeout=120, limits=limits) as http,
            DistributedRuntime(frontend.discovery) as rt,
        ):

            async def one(i: int) -> httpx.Response:
                body = {
                    "model": chat_model.name,
                    "prompt": [(i * 31 + j * 7) % 150 + 20 for j in range(PROMPT_TOKENS)],
                    "max_tokens": 8,
                    "ignore_eos": True,
                }
                return await http.post("/v1/completions", json=body)

            assert (await one(-1)).status_code == 200  # warm
            ended_before = sum((await load(rt, "backend")).requests_ended.values())
            before = {p: rss_mib(p) for p in (frontend.proc.pid, worker.pid)}
            queued: list[int] = []  # the worker's prompt tokens waiting for prefill, sampled
            sampling = asyncio.create_task(sample_queue(rt, queued))
            rate = CAPACITY_RPS * OVERLOAD
            tasks = []
            start = time.monotonic()
            for i in range(int(SECONDS * rate)):
                await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
                tasks.append(asyncio.create_task(one(i)))
            results = await asyncio.gather(*tasks)
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
            after = {p: rss_mib(p) for p in before}

            served = [r for r in results if r.status_code == 200]
            shed = [r for r in results if r.status_code == 503]
            assert len(served) + len(shed) == len(results), {r.status_code for r in results}
            assert len(shed) > len(results) / 2  # most of 10x the capacity is turned away
            assert len(served) > SECONDS * CAPACITY_RPS / 3  # and the worker kept serving
            assert all(r.headers["retry-after"] == "1" for r in shed)
            # Refused by the frontend: a shed request never reached the worker.
            ended = ended_before

            async def all_ended() -> bool:
                nonlocal ended
                ended = sum((await load(rt, "backend")).requests_ended.values())
                return ended - ended_before >= len(served)

            await poll(all_ended, 30, "the served requests did not all end at the worker")
            assert ended - ended_before == len(served)
            # No queue built up at the worker: 30 s of 10x the capacity would have queued
            # hundreds of thousands of prompt tokens; the threshold held it near its own size.
            assert len(queued) > 10 and max(queued) <= 2 * BUSY_PREFILL_TOKENS, queued
            for pid, mib in after.items():
                assert mib < before[pid] + 150, f"{pid}: {before[pid]:.0f} -> {mib:.0f} MiB"
            assert worker.poll() is None and frontend.proc.poll() is None
            assert (await http.get("/health")).status_code == 200
            await all_free(rt, "backend")


async def sample_queue(runtime: DistributedRuntime, queued: list[int]) -> None:
    """Append the worker's prompt tokens waiting for prefill every `SAMPLE_S`, until cancelled."""
    while True:
        queued.append((await load(runtime, "backend")).active_prefill_tokens)
        await asyncio.sleep(SAMPLE_S)


async def test_busy_thresholds_change_at_run_time(tmp_path: Path) -> None:
    async with (
        running_frontend(tmp_path, "--busy-kv-usage", "0.8") as frontend,
        httpx.AsyncClient(base_url=frontend.url) as http,
    ):
        now = (await http.get("/busy_threshold")).json()
        assert now == {"kv_usage": 0.8, "prefill_tokens": 16384, "retry_after_s": 1}
        r = await http.post("/busy_threshold", json={"prefill_tokens": None, "kv_usage": 0.5})
        assert r.status_code == 200
        assert r.json() == {"kv_usage": 0.5, "prefill_tokens": None, "retry_after_s": 1}
        for bad in ({"kv_usage": 2}, {"nope": 1}, [1]):
            r = await http.post("/busy_threshold", json=bad)
            assert r.status_code == 400 and r.json()["error"]["message"], bad
        r = await http.post("/busy_threshold", content=b"{")
        assert r.status_code == 400
        assert (await http.get("/busy_threshold")).json()["kv_usage"] == 0.5


@pytest.mark.unit
def test_a_zero_threshold_flag_turns_its_check_off() -> None:
    args = build_parser().parse_args(
        ["frontend", "--busy-kv-usage", "0", "--busy-prefill-tokens", "0"]
    )
    limits = busy_thresholds(args)
    assert (limits.kv_usage, limits.prefill_tokens) == (None, None)
