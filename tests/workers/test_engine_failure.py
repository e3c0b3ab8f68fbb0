"""A worker whose engine fails stops as a signal would stop it (deregistered, its streams
ended), and says why, so that its supervisor starts a new one; a worker whose engine serves
stops only when asked."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest

from kvbaton.engine import AsyncEngine
from kvbaton.protocols.llm import EngineOutput, PreprocessedRequest, SamplingParams
from kvbaton.runtime import Client, DistributedRuntime
from kvbaton.workers.llm_worker import LLMWorker
from tests.engine.step_loop import break_the_step_loop
from tests.helpers import wait_until

pytestmark = pytest.mark.unit


@contextlib.asynccontextmanager
async def served(
    engine: AsyncEngine,
) -> AsyncIterator[tuple[LLMWorker, Client, asyncio.Task[str | None]]]:
    """A worker serving `engine` (the task of its `serve`) and a client of it."""
    url = f"mem://{uuid.uuid4().hex}"
    async with DistributedRuntime(url) as caller_rt:
        worker_rt = DistributedRuntime(url)
        worker = LLMWorker(worker_rt, engine, served_name="m", namespace="t")
        serving = asyncio.create_task(worker.serve())
        try:
            client = await caller_rt.endpoint("t.backend.generate").client(
                response_type=EngineOutput
            )
            await client.wait_for_instances(10)
            yield worker, client, serving
            await client.close()
        finally:
            await worker_rt.shutdown()
            await asyncio.wait_for(serving, 10)


async def test_a_worker_whose_engine_fails_deregisters_and_says_why(
    serving_engine: AsyncEngine,
) -> None:
    async with served(serving_engine) as (worker, client, serving):
        request = PreprocessedRequest(
            model="m",
            token_ids=list(range(3, 12)),
            sampling=SamplingParams(max_tokens=10_000, ignore_eos=True),
        )
        stream = client.round_robin(request)
        await anext(stream)  # a stream under way when the engine breaks
        break_the_step_loop(serving_engine)

        failure = await asyncio.wait_for(serving, 10)
        assert failure is not None
        assert failure.startswith("the engine failed: the engine's step loop failed: KeyError")
        with pytest.raises(Exception, match="step loop failed"):
            async for _ in stream:
                pass
        await wait_until(lambda: not client.instances(), what="the worker deregistered")
        assert worker.load().requests_ended == {"error": 1}  # the stream under way


async def test_a_worker_asked_to_stop_reports_no_failure(serving_engine: AsyncEngine) -> None:
    async with served(serving_engine) as (worker, _, serving):
        await worker.runtime.shutdown()
        assert await asyncio.wait_for(serving, 10) is None
