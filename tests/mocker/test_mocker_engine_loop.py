"""The mocker's async engine (steps on the caller's loop): the tokens a hand-stepped mocker gives,
outputs no sooner than the timing model says, a run of steps at its pace, aborts and shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvbaton.engine import AsyncEngine, EngineConfig
from kvbaton.engine.connector import EngineRequest
from kvbaton.mocker import MockerTiming, create_mocker_engine
from kvbaton.mocker.runner import mocker_config
from kvbaton.protocols.llm import SamplingParams
from tests.engine.step_loop import assert_a_broken_step_loop_fails_every_caller
from tests.mocker.stepped import Mocker

pytestmark = pytest.mark.unit

PROMPTS = {"a": list(range(30, 50)), "b": list(range(60, 73))}
# Slow enough that a step is several of the loop's 1 ms timer ticks: pacing is measurable.
TIMING = MockerTiming(speedup_ratio=2.0)


def config(model: Path) -> EngineConfig:
    """The pool `Mocker` steps by hand has: 32 blocks of 4 tokens."""
    return mocker_config(model=str(model), num_kv_blocks=32, block_size=4)


async def test_tokens_are_the_mockers_and_come_at_the_timing_models_pace(
    mocker_model: Path,
) -> None:
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    by_hand = Mocker(mocker_model, TIMING)
    expected, simulated = by_hand.run(PROMPTS, params), by_hand.runner.busy_seconds
    engine = await create_mocker_engine(config(mocker_model), TIMING)
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        streams = {
            rid: await engine.add_request(EngineRequest(rid, prompt, params))
            for rid, prompt in PROMPTS.items()
        }

        async def read(rid: str) -> tuple[list[int], float]:
            tokens, first = [], None
            async for out in streams[rid]:
                first = loop.time() if first is None else first
                tokens += out.token_ids
            assert first is not None
            return tokens, first - started

        (a, a_first), (b, _) = await asyncio.gather(read("a"), read("b"))
        elapsed = loop.time() - started
        assert {"a": a, "b": b} == expected
        # The first output waits out the first step's time (a prefill of both prompts); the
        # run takes the model's time, give or take a timer tick a step.
        prefill_s = TIMING.step_seconds(sum(len(p) for p in PROMPTS.values()), 0, 0.0)
        assert a_first >= prefill_s
        assert elapsed >= simulated
    finally:
        await engine.shutdown()


@pytest.fixture
async def engine(mocker_model: Path) -> AsyncIterator[AsyncEngine]:
    """A mocker engine at Dynamo's timing, shut down after the test (again, if it did)."""
    eng = await create_mocker_engine(config(mocker_model), MockerTiming())
    yield eng
    await eng.shutdown()


async def test_an_abort_mid_run_ends_the_stream_and_shutdown_fails_the_rest(
    engine: AsyncEngine,
) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)  # 40 steps of 6 ms at least
    a = await engine.add_request(EngineRequest("a", PROMPTS["a"], params))
    b = await engine.add_request(EngineRequest("b", PROMPTS["b"], params))
    await anext(a)
    engine.abort("a")
    finishes = [out.finish_reason async for out in a]
    assert finishes[-1] == "abort"
    await anext(b)
    dump = await engine.kv_dump()  # between two steps, in order with the messages
    assert dump is not None
    await engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        async for _ in b:
            pass
    with pytest.raises(RuntimeError, match="shut down"):
        await engine.add_request(EngineRequest("c", PROMPTS["a"], SamplingParams(max_tokens=1)))


async def test_a_step_loop_that_breaks_fails_every_caller_and_refuses_more(
    engine: AsyncEngine,
) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)  # 40 steps of 6 ms at least
    stream = await engine.add_request(EngineRequest("a", PROMPTS["a"], params))
    await anext(stream)
    await assert_a_broken_step_loop_fails_every_caller(engine, stream, PROMPTS["b"])
