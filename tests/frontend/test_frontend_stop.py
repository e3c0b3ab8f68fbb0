"""A frontend told to stop lets its in-flight requests run for the drain time; those still
running then end in OpenAI's shape (an error event mid-stream, a 503 before the answer), and
the frontend exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import httpx
import pytest

from tests.conftest import WorkerFactory
from tests.frontend.fleet import mocker, ready, running_frontend

pytestmark = pytest.mark.integration

SLOW = ("--mocker-decode", "0,0,50")  # 50 ms a token: 200 tokens outlast the drain


async def test_requests_cut_by_a_stop_end_with_shutting_down(
    chat_model: Path, spawn_worker: WorkerFactory, tmp_path: Path
) -> None:
    async with running_frontend(tmp_path, "--drain-timeout", "1") as frontend:
        mocker(spawn_worker, chat_model, "agg", *SLOW)
        await ready(frontend, chat_model, prefill=0)
        body = {"model": chat_model.name, "prompt": "hi", "max_tokens": 200, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=frontend.url, timeout=60) as http:
            whole = asyncio.create_task(http.post("/v1/completions", json=body))
            async with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                lines = aiter(r.aiter_lines())
                first = await anext(lines)
                assert first.startswith("data: {")  # mid-stream now
                frontend.proc.send_signal(signal.SIGTERM)
                events = [line async for line in lines if line.startswith("data: ")]
            answer = await whole
        assert events and json.loads(events[-1][6:])["error"]["code"] == "shutting_down"
        assert "data: [DONE]" not in events
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "shutting_down"
        assert await asyncio.to_thread(frontend.proc.wait, 30) == 0
