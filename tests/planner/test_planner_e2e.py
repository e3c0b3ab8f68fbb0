"""`kvbaton planner` end to end: a frontend, and a planner process whose local connector starts
the mocker workers itself; load makes it grow the decode pool, the load's end shrinks it again
(after its patience), and no request is lost on the way."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvbaton.planner.types import Profile, ProfilePoint
from tests.frontend.conftest import Deployment, start_frontend, stop_cleanly
from tests.helpers import clean_env
from tests.tiny_models import build_chat_model

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

NS = "t"
INTERVAL_S = 2.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    """Curves that make one decode worker good for about two concurrent streams at the ITL
    target (10 ms), and one prefill worker plenty at the TTFT target."""
    path = tmp_path / "profile.json"
    path.write_bytes(
        Profile(
            engine="mocker",
            model="tiny-chat",
            prefill=[ProfilePoint(16, 5.0), ProfilePoint(4096, 50.0)],
            decode=[ProfilePoint(1, 5.0), ProfilePoint(8, 40.0)],
            decode_context=256,
        ).to_json()
    )
    return path


@pytest.fixture
async def frontend(tmp_path: Path) -> AsyncIterator[Deployment]:
    deployment = await asyncio.to_thread(start_frontend, tmp_path / "discovery", NS)
    try:
        yield deployment
    finally:
        await asyncio.to_thread(stop_cleanly, deployment)


@pytest.fixture
def planner(tmp_path: Path, frontend: Deployment, model: Path, profile: Path) -> Iterator[Path]:
    """A `kvbaton planner` process; yields its log file."""
    worker_flags = (
        f"--engine mocker --model {model} --max-model-len 4096 --speedup-ratio 10 "
        "--block-size 16 --num-kv-blocks 1024"
    )
    log = open(tmp_path / "planner.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvbaton",
            "planner",
            "--frontend",
            frontend.url,
            "--namespace",
            NS,
            "--discovery",
            frontend.discovery,
            "--lease-ttl",
            "3",
            "--profile",
            str(profile),
            "--ttft-ms",
            "1000",
            "--itl-ms",
            "10",
            "--interval",
            str(INTERVAL_S),
            "--max-decode",
            "3",
            "--max-prefill",
            "2",
            "--scale-down-patience",
            "2",
            "--worker-flags",
            worker_flags,
            "--worker-log-dir",
            str(tmp_path / "workers"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=clean_env(),
    )
    log.close()
    try:
        yield tmp_path / "planner.log"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # it stops the workers it started
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        print((tmp_path / "planner.log").read_text()[-6000:])  # shown when the test fails


async def decode_workers(http: httpx.AsyncClient) -> int:
    body = (await http.get("/health")).json()
    return sum(len(ids) for ids in body["models"].values())


async def until(check, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout}s"
        await asyncio.sleep(0.2)


async def test_the_planner_grows_and_shrinks_the_decode_pool_losing_nothing(
    planner: Path, frontend: Deployment, model: Path
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="none", max_retries=0)
    async with httpx.AsyncClient(base_url=frontend.url) as http:

        async def started() -> bool:
            return await decode_workers(http) == 1 and bool(
                (await http.get("/health")).json()["prefill"]
            )

        await until(started, 90, "the planner's first workers (1 prefill, 1 decode)")

        done: list[int] = []
        stop = asyncio.Event()

        async def lane(n: int, pause: float = 0.0) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                await asyncio.sleep(pause)
                reply = await asyncio.wait_for(
                    client.completions.create(
                        model=model.name,
                        prompt=f"lane {n} request {i}: " + "once upon a time " * 4,
                        max_tokens=32,
                        extra_body={"ignore_eos": True},
                    ),
                    30,
                )
                assert reply.choices[0].finish_reason == "length"  # whole: nothing lost
                assert reply.usage is not None and reply.usage.completion_tokens == 32
                done.append(n)

        lanes = [asyncio.create_task(lane(n)) for n in range(8)]

        async def grown() -> bool:
            return await decode_workers(http) >= 2

        await until(grown, 60, "the decode pool grown under load")
        peak = await decode_workers(http)
        await asyncio.sleep(2 * INTERVAL_S)
        stop.set()
        await asyncio.gather(*lanes)  # every request of the load completed whole
        served = len(done)

        # A light load goes on while the pool shrinks: the workers that stop drain first.
        stop.clear()
        light = asyncio.create_task(lane(99, pause=0.3))

        async def shrunk() -> bool:
            return await decode_workers(http) == 1

        # Patience (2 intervals), then at most 2 workers per interval, then the drain.
        await until(shrunk, 60, "the decode pool back to its minimum")
        await asyncio.sleep(2.0)
        stop.set()
        await light  # every request sent while shrinking completed whole
        assert done.count(99) > 0
        cluster = (await http.get("/v1/cluster")).json()
    assert peak >= 2 and served > 0
    # Each worker it started logged where it was told (nothing left in the system's temp dir).
    assert len(list((planner.parent / "workers").glob("decode-*.log"))) >= peak
    # Every decision is logged with its inputs: the observed interval and the decided counts.
    text = await asyncio.to_thread(planner.read_text)
    decisions = re.findall(r"planner decision: prefill (\d+) -> (\d+), decode (\d+) -> (\d+)", text)
    decode_counts = [int(d[3]) for d in decisions]
    assert max(decode_counts) >= 2 and decode_counts[-1] == 1, decisions
    assert "request_rate=" in text
    # The frontend's cluster page shows the planner's last decisions and the workers it started.
    planned = cluster["planner"]["decisions"]  # newest first
    assert planned and cluster["planner"]["interval_s"] == INTERVAL_S
    assert [p["role"] for p in planned[0]["pools"]] == ["prefill", "decode"]
    assert planned[0]["pools"][1]["wanted"] == 1 and planned[0]["applied"]
    up = {w["role"] for w in cluster["workers"] if w["state"] == "up"}
    assert up == {"prefill", "decode"}
