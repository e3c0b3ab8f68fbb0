"""Request migration: a request whose worker went away goes on on another worker.

An attempt ends in migration when its stream breaks (`StreamBrokenError`: the worker died or the
connection was lost) or when its worker stays silent past a timeout (`first_output_s` for the
first output, `idle_s` between outputs; the silent attempt is cancelled at its worker). The
request is then sent again, routed afresh (away from the workers it was lost on, while there are
others), with the tokens produced so far appended to its prompt and `max_tokens` and
`min_tokens` reduced by as many. The consumer sees one stream: every token once, in order, and a
final `usage` counted against the original prompt.

A greedy request goes on with exactly the tokens it would have had: on the mocker always, on a
model up to the numerics of computing the produced tokens as prompt rather than one by one. A
stream lost after its last token ends as if its end had come, whatever the request. Not
migrated, because their state cannot be carried to another worker (the error reaches the client
as before):
- seeded sampling at temperature > 0: the seed's random stream has advanced at the lost worker,
  and the new one would start it over;
- frequency or presence penalties: they count the request's outputs, which the new worker
  would see as prompt;
- a request pinned to one worker (`nvext.backend_instance_id`): there is no other;
- a request that has already migrated `limit` times.
A silent attempt that is not migrated fails with a 504 naming the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable

import msgspec

from kvbaton.frontend.errors import OpenAIError
from kvbaton.frontend.settings import MigrationSettings
from kvbaton.protocols.llm import EngineOutput, PreprocessedRequest, Usage
from kvbaton.runtime.errors import StreamBrokenError

log = logging.getLogger(__name__)

# attempt(request, migrated): the outputs of one try at `request`; `migrated`: it is a
# continuation (the client was answered already: it must not be shed).
Attempt = Callable[[PreprocessedRequest, bool], AsyncGenerator[EngineOutput, None]]


class WorkerSilentError(Exception):
    """An attempt's worker sent nothing within its timeout."""


def not_migratable(request: PreprocessedRequest) -> str | None:
    """Why `request`'s state cannot be carried to another worker, or None if it can."""
    return request.sampling.state_beyond_tokens()


def continuation(request: PreprocessedRequest, produced: list[int]) -> PreprocessedRequest:
    """`request` to send again after `produced` (fewer than its max_tokens) were generated."""
    guided, budget = request.sampling.guided, request.sampling.thinking_budget
    if guided is not None:  # the new worker replays them through the constraint
        guided = msgspec.structs.replace(guided, replay=guided.replay + len(produced))
    if budget is not None:  # ... and counts the reasoning among them
        budget = msgspec.structs.replace(budget, replay=budget.replay + len(produced))
    sampling = msgspec.structs.replace(
        request.sampling,
        max_tokens=request.sampling.max_tokens - len(produced),
        min_tokens=max(0, request.sampling.min_tokens - len(produced)),
        guided=guided,
        thinking_budget=budget,
        # the first output brought them (nothing produced: none came yet)
        prompt_logprobs=None if produced else request.sampling.prompt_logprobs,
    )
    return msgspec.structs.replace(
        request, token_ids=request.token_ids + produced, sampling=sampling
    )


async def _timed(
    outputs: AsyncGenerator[EngineOutput, None], first_s: float, idle_s: float
) -> AsyncGenerator[EngineOutput, None]:
    """`outputs`, each within its timeout, else WorkerSilentError.

    - Only the waits for the worker count, not the consumer's time between outputs.
    - One timer per attempt, re-armed when it fires before a wait's end: an output costs no
      timer of its own (a timeout per output was 7% of the frontend's CPU under load).
    - A cancellation from elsewhere, and a TimeoutError of the worker's own, pass through.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    limit, first = first_s, True  # `first`: no output came yet
    waiting_since: float | None = None  # set only while this task awaits the worker
    fired = False
    timer: asyncio.TimerHandle

    def check() -> None:
        nonlocal timer, fired
        now = loop.time()
        if waiting_since is not None and now - waiting_since >= limit:
            fired = True
            task.cancel()
        else:
            timer = loop.call_at((now if waiting_since is None else waiting_since) + limit, check)

    timer = loop.call_at(loop.time() + limit, check)
    try:
        while True:
            waiting_since = loop.time()
            try:
                out = await anext(outputs)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if fired and task.uncancel() == 0:
                    what = "its first output" if first else "between outputs"
                    raise WorkerSilentError(
                        f"the worker sent nothing for {limit:g} s ({what})"
                    ) from None
                raise
            finally:
                waiting_since = None
            if first:
                limit, first = idle_s, False
                timer.cancel()
                timer = loop.call_at(loop.time() + limit, check)
            yield out
    finally:
        timer.cancel()


def _whole_usage(usage: Usage, original_prompt: int, produced_before: int) -> Usage:
    """A continuation's usage, counted against the original request."""
    return Usage(
        prompt_tokens=original_prompt,
        completion_tokens=usage.completion_tokens + produced_before,
        cached_tokens=min(usage.cached_tokens, original_prompt),
    )


async def migrating(
    attempt: Attempt,
    request: PreprocessedRequest,
    request_id: str,
    settings: MigrationSettings,
    pinned: bool = False,
    on_lost: Callable[[Exception, bool], None] = lambda exc, migrates: None,
) -> AsyncGenerator[EngineOutput, None]:
    """`attempt(request, False)`'s outputs; on a broken or silent attempt, those of
    `attempt(continuation(...), True)` (see the module's docstring). Nothing is sent again
    once an output with a finish reason came. `on_lost(exc, migrates)`: an attempt was lost;
    `migrates`: the request is sent again."""
    produced: list[int] = []
    migrations = 0
    current = request
    while True:
        before = len(produced)
        outputs = attempt(current, migrations > 0)
        try:
            async with contextlib.aclosing(outputs):
                timed = _timed(outputs, settings.first_output_s, settings.idle_s)
                async with contextlib.aclosing(timed):
                    async for out in timed:
                        produced += out.token_ids
                        if before and out.usage is not None:
                            out.usage = _whole_usage(out.usage, len(request.token_ids), before)
                        yield out
                        if out.finish_reason is not None:
                            return
            return
        except (StreamBrokenError, WorkerSilentError) as exc:
            end_lost = len(produced) >= request.sampling.max_tokens  # only the end was lost
            why = (
                "only its end was lost"
                if end_lost
                else "it is pinned to its worker"
                if pinned
                else f"it migrated {migrations} times already"
                if migrations >= settings.limit
                else not_migratable(request)
            )
            on_lost(exc, why is None)
            if end_lost:
                yield EngineOutput(
                    request_id=request_id,
                    token_ids=[],
                    finish_reason="length",
                    usage=Usage(
                        prompt_tokens=len(request.token_ids), completion_tokens=len(produced)
                    ),
                )
                return
            if why is not None:
                if isinstance(exc, WorkerSilentError):
                    raise OpenAIError(504, str(exc), code="worker_timeout") from exc
                raise
            reason = exc
        migrations += 1
        log.warning(
            "request %s: %s after %d tokens; migrating (%d of at most %d)",
            request_id,
            reason,
            len(produced),
            migrations,
            settings.limit,
        )
        current = continuation(request, produced)
