"""The async face that workers use: concurrent streams, early exit aborts, clear errors."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvbaton.engine import AsyncEngine, EngineConfig, SamplingParams
from kvbaton.engine.connector import EngineRequest, KvLoad, KvLoadFailed
from tests.engine.conftest import TEST_DEVICE
from tests.engine.reference import hf_greedy, prompts
from tests.engine.step_loop import assert_a_broken_step_loop_fails_every_caller
from tests.helpers import wait_until

pytestmark = pytest.mark.unit


@pytest.fixture
async def engine(tiny_models: dict[str, Path]) -> AsyncIterator[AsyncEngine]:
    config = EngineConfig(
        model=str(tiny_models["llama-tied"]),
        dtype="float32",
        device=TEST_DEVICE,
        block_size=8,
        num_kv_blocks=128,
    )
    eng = await AsyncEngine.create(config)
    yield eng
    await eng.shutdown()


async def test_concurrent_requests_stream_their_own_tokens(
    engine: AsyncEngine, tiny_models: dict[str, Path]
) -> None:
    params = SamplingParams(max_tokens=12, temperature=0)

    async def one(i: int, prompt: list[int]) -> tuple[list[int], str | None]:
        tokens: list[int] = []
        reason = None
        async for out in await engine.add_request(EngineRequest(f"r{i}", prompt, params)):
            tokens += out.token_ids
            reason = out.finish_reason
            if reason:
                assert out.usage is not None and out.usage.completion_tokens == 12
        return tokens, reason

    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts())))
    model_dir = tiny_models["llama-tied"]
    assert [r[0] for r in results] == [hf_greedy(model_dir, tuple(p)) for p in prompts()]
    assert {r[1] for r in results} == {"length"}


async def test_leaving_early_aborts_and_frees_the_blocks(engine: AsyncEngine) -> None:
    stream = await engine.add_request(
        EngineRequest("long", prompts()[5], SamplingParams(max_tokens=200, temperature=0))
    )
    async for _ in stream:
        break
    await stream.aclose()  # type: ignore[attr-defined]
    await wait_until(
        lambda: engine.stats().kv_blocks_used == 0 and engine.stats().running == 0,
        10,
        "blocks freed",
    )


async def test_a_reader_that_lags_reads_the_waiting_outputs_as_one(
    engine: AsyncEngine, tiny_models: dict[str, Path]
) -> None:
    prompt = prompts()[2]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1)
    stream = await engine.add_request(EngineRequest("lags", prompt, params))
    first = await anext(stream)
    await wait_until(lambda: engine.stats().running == 0, 10, "the request finished")
    rest = [out async for out in stream]
    assert len(rest) <= 2  # all at once, or the last one delivered after the check
    tokens = first.token_ids + [t for out in rest for t in out.token_ids]
    assert tokens == hf_greedy(tiny_models["llama-tied"], tuple(prompt))
    assert sum(len(out.logprobs or []) for out in [first, *rest]) == 12
    assert rest[-1].finish_reason == "length" and rest[-1].usage is not None


async def test_bad_requests_fail_at_once(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        await engine.add_request(EngineRequest("bad", [], SamplingParams()))
    with pytest.raises(ValueError, match="max_tokens"):
        await engine.add_request(EngineRequest("bad", [5], SamplingParams(max_tokens=0)))


async def test_every_loading_request_starts_its_load_at_once(engine: AsyncEngine) -> None:
    """A decode-first load waits in its room until the prefill worker wrote the KV (seconds,
    minutes if it queues there), and a room is announced only once its load started: loads
    must not wait for each other's threads, or the prefill worker sees a handful at a time."""
    started: list[str] = []
    written = threading.Event()

    class Room:
        def load(self, load: KvLoad) -> list[int]:
            started.append(load.request_id)
            assert written.wait(10)
            raise KvLoadFailed("not written here: prefill it")

    params = SamplingParams(max_tokens=2, temperature=0)
    streams = [
        await engine.add_request(EngineRequest(f"r{i}", [5 + i, 6, 7], params, kv_source=Room()))
        for i in range(12)  # three times as many as the engine had load threads
    ]
    try:
        await wait_until(lambda: len(started) == 12, 10, "every load started")
    finally:
        written.set()
    for stream in streams:
        assert len([t async for out in stream for t in out.token_ids]) == 2


async def test_a_step_loop_that_breaks_fails_every_caller_and_refuses_more(
    engine: AsyncEngine,
) -> None:
    stream = await engine.add_request(
        EngineRequest("long", prompts()[5], SamplingParams(max_tokens=200, temperature=0))
    )
    await anext(stream)
    await assert_a_broken_step_loop_fails_every_caller(engine, stream, prompts()[0])
