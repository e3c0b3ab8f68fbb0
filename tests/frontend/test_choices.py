"""A request's choices without a deployment: the requests `n` forks (order, per-choice seeds),
the home a prompt's first choice reports, and usage that counts each prompt once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvbaton.frontend.choices import PromptHome, fork_requests
from kvbaton.frontend.responses import ResponseShape
from kvbaton.protocols.llm import PreprocessedRequest, SamplingParams

pytestmark = pytest.mark.unit


def request(prompt: list[int], seed: int | None) -> PreprocessedRequest:
    return PreprocessedRequest(model="m", token_ids=prompt, sampling=SamplingParams(seed=seed))


def test_each_prompt_is_forked_n_times_in_index_order_with_seeds_plus_the_choice() -> None:
    forked = fork_requests([request([1, 2], 7), request([3], 7)], 3)
    assert [r.token_ids for r in forked] == [[1, 2]] * 3 + [[3]] * 3
    assert [r.sampling.seed for r in forked] == [7, 8, 9] * 2
    unseeded = fork_requests([request([1], None)], 2)
    assert [r.sampling.seed for r in unseeded] == [None, None]
    assert fork_requests([request([1], 5)], 1) == [request([1], 5)]


async def test_the_first_report_of_a_home_counts() -> None:
    home = PromptHome()
    waiting = asyncio.ensure_future(home.wait())
    await asyncio.sleep(0)
    assert not waiting.done()
    home.found(0xA)
    home.found(None)  # the first choice ended after: changes nothing
    assert await waiting == 0xA and await home.wait() == 0xA


def test_usage_counts_each_prompt_once_and_every_choice_s_completion() -> None:
    def state(prompt: int, completion: int, cached: int) -> SimpleNamespace:
        return SimpleNamespace(
            prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached
        )

    # Two prompts (40 and 21 tokens), two choices each; the later choices hit the cache.
    states = {0: state(40, 5, 0), 1: state(40, 5, 32), 2: state(21, 4, 16), 3: state(21, 6, 16)}
    shape = ResponseShape("r", "m", False, 4, per_prompt=2)
    usage = shape.usage_chunk(states)["usage"]  # type: ignore[arg-type]
    assert usage == {
        "prompt_tokens": 61,
        "completion_tokens": 20,
        "total_tokens": 81,
        "prompt_tokens_details": {"cached_tokens": 16},  # as each prompt's first choice found
    }
