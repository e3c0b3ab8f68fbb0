"""A disconnect storm: 500 streaming clients that hang up, some mid-stream and some before their
first token. Afterwards every KV block is free at the worker, nothing runs or waits there, and
the frontend's in-flight gauge is back to zero; the deployment still serves."""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path

import httpx
import pytest

from kvbaton.runtime import DistributedRuntime
from tests.conftest import WorkerFactory
from tests.frontend.fleet import load, poll, ready, running_frontend

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NS = "t"
CLIENTS = 500
_IN_FLIGHT = re.compile(r"^kvbaton_frontend_inflight_requests\{[^}]*\} (\S+)$", re.M)


async def test_500_clients_hanging_up_leave_no_block_and_no_request_behind(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path
) -> None:
    no_shedding = ("--busy-prefill-tokens", "0", "--busy-kv-usage", "0")  # all 500 get in
    async with running_frontend(tmp_path, *no_shedding) as frontend:
        spawn_worker(
            *("--model", str(chat_model), "--block-size", "16", "--num-kv-blocks", "4096"),
            # About 30 ms a step: streams last long enough to be cut.
            *("--speedup-ratio", "0.2", "--max-model-len", "1024"),
            engine="mocker",
            lease_ttl=30.0,
            namespace=NS,
        )
        await ready(frontend, chat_model, prefill=0)
        rng = random.Random(0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=frontend.url, timeout=60, limits=limits) as http:

            async def hang_up(i: int) -> int:
                """Stream, then leave after a few chunks, every other client at a random moment
                too (it can come before the first token): chunks read. The other half wait for
                their chunks: how many first tokens come within a moment depends on the
                machine."""
                body = {
                    "model": chat_model.name,
                    "prompt": [(i * 7 + j) % 150 + 20 for j in range(64)],
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "stream": True,
                }
                chunks, leave_after = 0, rng.randint(0, 5)
                moment = rng.uniform(0.05, 3.0) if i % 2 else None
                try:
                    async with asyncio.timeout(moment):
                        async with http.stream("POST", "/v1/completions", json=body) as r:
                            assert r.status_code == 200
                            async for _ in r.aiter_lines():
                                chunks += 1
                                if chunks > leave_after:
                                    break
                except TimeoutError:
                    pass  # hung up before the chunks it wanted
                return chunks

            read = await asyncio.gather(*(hang_up(i) for i in range(CLIENTS)))
            assert sum(1 for c in read if c > 0) > CLIENTS / 10  # many left mid-stream

            async with DistributedRuntime(frontend.discovery) as rt:

                async def idle() -> bool:
                    worker = await load(rt, "backend")
                    return worker.kv_blocks_used == worker.running == worker.waiting == 0

                await poll(idle, 60, "the worker still holds blocks or requests")

            async def gauges_zero() -> bool:
                text = (await http.get("/metrics")).text
                values = [float(v) for v in _IN_FLIGHT.findall(text)]
                return bool(values) and not any(values)

            await poll(gauges_zero, 30, "the frontend still counts requests in flight")
            body = {"model": chat_model.name, "prompt": "hello", "max_tokens": 3}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
