"""Request migration, with scripted attempts in place of workers: what a continuation carries,
which requests may migrate and how often, silent workers, and the usage the client sees."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from kvbaton.frontend.errors import OpenAIError
from kvbaton.frontend.migration import continuation, migrating, not_migratable
from kvbaton.frontend.settings import MigrationSettings
from kvbaton.protocols.llm import (
    EngineOutput,
    Guided,
    PreprocessedRequest,
    SamplingParams,
    ThinkingBudget,
    Usage,
)
from kvbaton.runtime.errors import StreamBrokenError

pytestmark = pytest.mark.unit

PROMPT = [5, 6, 7]


def request(**sampling: object) -> PreprocessedRequest:
    params = SamplingParams(**{"max_tokens": 6, "temperature": 0.0, **sampling})  # type: ignore[arg-type]
    return PreprocessedRequest(model="m", token_ids=PROMPT, sampling=params)


class Worker:
    """Attempts that each send their tokens, then break (or hang, or finish)."""

    def __init__(self, *plans: tuple[list[int], str]) -> None:
        self.plans = list(plans)  # (tokens, then: "break" | "hang" | "finish" | "finish+break")
        self.seen: list[PreprocessedRequest] = []
        self.closed = 0

    async def attempt(
        self, req: PreprocessedRequest, migrated: bool
    ) -> AsyncGenerator[EngineOutput, None]:
        assert migrated == bool(self.seen)
        self.seen.append(req)
        tokens, then = self.plans.pop(0)
        try:
            for i, token in enumerate(tokens):
                last = then.startswith("finish") and i == len(tokens) - 1
                yield EngineOutput(
                    request_id="r",
                    token_ids=[token],
                    finish_reason="length" if last else None,
                    usage=Usage(
                        prompt_tokens=len(req.token_ids),
                        completion_tokens=len(tokens),
                        cached_tokens=len(req.token_ids),
                    )
                    if last
                    else None,
                )
            if then.endswith("break"):
                raise StreamBrokenError("the worker went away")
            if then == "hang":
                await asyncio.sleep(3600)
        finally:
            self.closed += 1


async def collect(
    worker: Worker, req: PreprocessedRequest, settings: MigrationSettings | None = None, **kw: bool
) -> list[EngineOutput]:
    stream = migrating(worker.attempt, req, "r", settings or MigrationSettings(), **kw)
    return [out async for out in stream]


async def test_a_broken_stream_goes_on_with_the_produced_tokens_in_the_prompt() -> None:
    worker = Worker(([1, 2], "break"), ([3], "break"), ([4, 5, 6], "finish"))
    outs = await collect(worker, request(min_tokens=4))
    assert [t for o in outs for t in o.token_ids] == [1, 2, 3, 4, 5, 6]
    first, second, third = worker.seen
    assert first.token_ids == PROMPT and first.sampling.max_tokens == 6
    assert second.token_ids == [*PROMPT, 1, 2] and second.sampling.max_tokens == 4
    assert second.sampling.min_tokens == 2
    assert third.token_ids == [*PROMPT, 1, 2, 3] and third.sampling.max_tokens == 3
    assert third.sampling.min_tokens == 1
    assert outs[-1].finish_reason == "length"
    # Usage counts against the original prompt; cached tokens never exceed it.
    assert outs[-1].usage == Usage(prompt_tokens=3, completion_tokens=6, cached_tokens=3)
    assert worker.closed == 3


async def test_the_limit_and_unmigratable_requests_let_the_error_through() -> None:
    worker = Worker(([1], "break"), ([2], "break"))
    with pytest.raises(StreamBrokenError):
        await collect(worker, request(), MigrationSettings(limit=1))
    assert len(worker.seen) == 2
    for req in (request(temperature=0.7, seed=3), request(frequency_penalty=0.5)):
        assert not_migratable(req)
        with pytest.raises(StreamBrokenError):
            await collect(Worker(([1], "break")), req)
    assert not_migratable(request(temperature=0.7)) is None  # unseeded: nothing to carry
    assert not_migratable(request(seed=3)) is None  # greedy: the seed draws nothing
    with pytest.raises(StreamBrokenError):
        await collect(Worker(([1], "break")), request(), pinned=True)


async def test_a_silent_worker_is_given_up_on() -> None:
    settings = MigrationSettings(first_output_s=0.2, idle_s=0.2)
    worker = Worker(([1, 2], "hang"), ([], "hang"), ([3, 4, 5, 6], "finish"))
    outs = await collect(worker, request(), settings)
    assert [t for o in outs for t in o.token_ids] == [1, 2, 3, 4, 5, 6]
    assert worker.closed == 3  # each silent attempt was cancelled
    with pytest.raises(OpenAIError, match=r"nothing for 0\.2 s") as info:
        await collect(Worker(([1], "hang")), request(), MigrationSettings(limit=0, idle_s=0.2))
    assert info.value.status == 504


async def test_only_the_waits_for_the_worker_count_against_its_timeouts() -> None:
    # A consumer slower than the idle limit between outputs: the worker was never silent.
    settings = MigrationSettings(limit=0, first_output_s=0.3, idle_s=0.1)
    worker = Worker(([1, 2, 3], "finish"))
    tokens = []
    async for out in migrating(worker.attempt, request(), "r", settings):
        tokens += out.token_ids
        await asyncio.sleep(0.25)
    assert tokens == [1, 2, 3]
    # An idle limit shorter than the first output's holds from the first output on.
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(OpenAIError, match=r"nothing for 0\.1 s \(between outputs\)"):
        await collect(
            Worker(([1], "hang")),
            request(),
            MigrationSettings(limit=0, first_output_s=30, idle_s=0.1),
        )
    assert loop.time() - started < 10
    with pytest.raises(OpenAIError, match=r"nothing for 0\.1 s \(its first output\)"):
        await collect(
            Worker(([], "hang")), request(), MigrationSettings(limit=0, first_output_s=0.1)
        )


async def test_a_cancellation_or_a_worker_s_own_timeout_is_not_silence() -> None:
    async def timing_out(
        req: PreprocessedRequest, migrated: bool
    ) -> AsyncGenerator[EngineOutput, None]:
        yield EngineOutput(request_id="r", token_ids=[1])
        raise TimeoutError("the worker's own")

    settings = MigrationSettings(limit=0, first_output_s=0.1, idle_s=0.1)
    with pytest.raises(TimeoutError, match="own"):
        [o async for o in migrating(timing_out, request(), "r", settings)]
    # Cancelled from outside while it waits for the worker: a cancellation, not silence.
    task = asyncio.ensure_future(collect(Worker(([1], "hang")), request(), settings))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_stream_lost_after_its_last_token_ends_without_another_attempt() -> None:
    for pinned in (False, True):  # whatever the request: nothing is left to migrate
        worker = Worker(([1, 2, 3, 4, 5, 6], "break"))
        outs = await collect(worker, request(), pinned=pinned)
        assert len(worker.seen) == 1
        assert outs[-1].finish_reason == "length"
        assert outs[-1].usage == Usage(prompt_tokens=3, completion_tokens=6)


async def test_nothing_is_sent_again_after_a_finish_and_each_loss_is_reported() -> None:
    worker = Worker(([1, 2, 3], "finish+break"))  # finishes early (a stop token), then breaks
    outs = await collect(worker, request())
    assert [o.finish_reason for o in outs] == [None, None, "length"]
    assert len(worker.seen) == 1
    lost: list[tuple[type[Exception], bool]] = []

    def on_lost(exc: Exception, migrates: bool) -> None:
        lost.append((type(exc), migrates))

    worker = Worker(([1], "break"), ([2, 3, 4, 5, 6], "finish"))
    stream = migrating(worker.attempt, request(), "r", MigrationSettings(), on_lost=on_lost)
    assert len([o async for o in stream]) == 6
    assert lost == [(StreamBrokenError, True)]
    lost.clear()  # the limit reached: lost, not migrated
    worker = Worker(([1], "break"), ([2], "break"))
    stream = migrating(worker.attempt, request(), "r", MigrationSettings(limit=1), on_lost=on_lost)
    with pytest.raises(StreamBrokenError):
        [o async for o in stream]
    assert lost == [(StreamBrokenError, True), (StreamBrokenError, False)]
    lost.clear()  # pinned to its worker: not migrated
    worker = Worker(([1], "break"))
    stream = migrating(worker.attempt, request(), "r", MigrationSettings(), True, on_lost)
    with pytest.raises(StreamBrokenError):
        [o async for o in stream]
    assert lost == [(StreamBrokenError, False)]
    lost.clear()  # only the end lost: not migrated
    worker = Worker(([1, 2, 3, 4, 5, 6], "break"))
    stream = migrating(worker.attempt, request(), "r", MigrationSettings(), on_lost=on_lost)
    assert [o.finish_reason for o in [o async for o in stream]][-1] == "length"
    assert lost == [(StreamBrokenError, False)]


def test_continuation_and_settings() -> None:
    req = request(max_tokens=10, min_tokens=3)
    cont = continuation(req, [9, 9, 9, 9])
    assert cont.token_ids == [*PROMPT, 9, 9, 9, 9]
    assert (cont.sampling.max_tokens, cont.sampling.min_tokens) == (6, 0)
    assert req.token_ids == PROMPT  # the original is left as it was
    constrained = request(max_tokens=10, guided=Guided(kind="regex", spec="9+"))
    again = continuation(continuation(constrained, [9, 9]), [9])
    assert again.sampling.guided == Guided(kind="regex", spec="9+", replay=3)  # all 3 replayed
    budgeted = request(max_tokens=10, thinking_budget=ThinkingBudget(tokens=4, end=7))
    again = continuation(continuation(budgeted, [9, 9]), [9])
    assert again.sampling.thinking_budget == ThinkingBudget(tokens=4, end=7, replay=3)
    scored = request(max_tokens=10, prompt_logprobs=1)  # the first output brings them
    assert continuation(scored, []).sampling.prompt_logprobs == 1
    assert continuation(scored, [9]).sampling.prompt_logprobs is None
    with pytest.raises(ValueError, match="limit"):
        MigrationSettings(limit=-1)
    with pytest.raises(ValueError, match="timeouts"):
        MigrationSettings(idle_s=0)
