"""Overload: 10x what the deployment can serve, for 30 s, against a frontend and one mocker
worker (real processes). The excess is refused at once (503, Retry-After), the requests taken
are served without the unbounded wait a queue would give them, memory stays bounded and
nothing crashes. And the busy thresholds change at run time."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from kvbaton.cli.frontend_flags import busy_thresholds
from kvbaton.cli.main import build_parser
from kvbaton.runtime import DistributedRuntime
from tests.conftest import WorkerFactory
from tests.frontend.fleet import all_free, ready, running_frontend

pytestmark = pytest.mark.integration

NS = "t"
PROMPT_TOKENS = 200
# One prompt per step at 1 ms a prompt token: about 5 requests/s at most.
CAPACITY_RPS = 5.0
OVERLOAD = 10
SECONDS = 30.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.slow
@pytest.mark.alone  # it judges how fast the excess is refused
async def test_ten_times_the_capacity_is_shed_quickly_and_the_rest_served(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path
) -> None:
    flags = ("--busy-prefill-tokens", str(5 * PROMPT_TOKENS), "--busy-kv-usage", "0.9")
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
        async with httpx.AsyncClient(base_url=frontend.url, timeout=120, limits=limits) as http:

            async def one(i: int) -> tuple[int, float, httpx.Headers]:
                body = {
                    "model": chat_model.name,
                    "prompt": [(i * 31 + j * 7) % 150 + 20 for j in range(PROMPT_TOKENS)],
                    "max_tokens": 8,
                    "ignore_eos": True,
                }
                started = time.monotonic()
                r = await http.post("/v1/completions", json=body)
                return r.status_code, time.monotonic() - started, r.headers

            assert (await one(-1))[0] == 200  # warm
            before = {p: rss_mib(p) for p in (frontend.proc.pid, worker.pid)}
            rate = CAPACITY_RPS * OVERLOAD
            tasks = []
            start = time.monotonic()
            for i in range(int(SECONDS * rate)):
                await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
                tasks.append(asyncio.create_task(one(i)))
            results = await asyncio.gather(*tasks)
            after = {p: rss_mib(p) for p in before}

            served = [t for status, t, _ in results if status == 200]
            shed = [(t, h) for status, t, h in results if status == 503]
            assert len(served) + len(shed) == len(results), {s for s, _, _ in results}
            assert len(shed) > len(results) / 2  # most of 10x the capacity is turned away
            assert len(served) > SECONDS * CAPACITY_RPS / 3  # and the worker kept serving
            assert all(h["retry-after"] == "1" for _, h in shed)
            # Refused at once, not after a wait; served without the minutes a queue of 30 s of
            # 10x the capacity would have built.
            assert sorted(t for t, _ in shed)[int(len(shed) * 0.99)] < 2.0
            assert max(served) < 15.0
            for pid, mib in after.items():
                assert mib < before[pid] + 150, f"{pid}: {before[pid]:.0f} -> {mib:.0f} MiB"
            assert worker.poll() is None and frontend.proc.poll() is None
            assert (await http.get("/health")).status_code == 200
            async with DistributedRuntime(frontend.discovery) as rt:
                await all_free(rt, "backend")


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
