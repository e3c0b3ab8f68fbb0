"""kvbaton's sampling options as vLLM's, and vLLM's logprobs as kvbaton's (no engine started).
Runs where vLLM is installed (scripts/vllm_env.sh); skipped elsewhere."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from kvbaton.engine.vllm_params import (
    REPLAYED_CONSTRAINT,
    token_logprobs,
    vllm_sampling_params,
)
from kvbaton.protocols.llm import Guided, SamplingParams, ThinkingBudget, TokenLogprob
from tests.helpers import NEEDS_VLLM

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.unit,
    NEEDS_VLLM,
]


def test_every_field_maps() -> None:
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=7,
        min_tokens=2,
        temperature=0.5,
        top_p=0.9,
        top_k=-1,
        min_p=0.05,
        seed=3,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        presence_penalty=-0.3,
        ignore_eos=True,
        stop_token_ids=[5, 6],
        logprobs=2,
        prompt_logprobs=1,
        logit_bias={9: 1.5},
    ).validate()
    ours = vllm_sampling_params(params)
    assert (ours.max_tokens, ours.min_tokens, ours.temperature) == (7, 2, 0.5)
    assert (ours.top_p, ours.top_k, ours.min_p, ours.seed) == (0.9, 0, 0.05, 3)
    assert (ours.repetition_penalty, ours.frequency_penalty, ours.presence_penalty) == (
        1.1,
        0.2,
        -0.3,
    )
    assert ours.ignore_eos and ours.stop_token_ids == [5, 6] and ours.logprobs == 2
    assert ours.prompt_logprobs == 1
    assert ours.logit_bias == {9: 1.5}
    assert ours.output_kind is RequestOutputKind.DELTA and ours.n == 1


PROPERTIES_CLOSED = '{"properties": {"a": {}}, "additionalProperties": false}'


@pytest.mark.parametrize(
    ("kind", "spec", "field", "value"),
    [
        ("json", '{"type": "object"}', "json", '{"type": "object"}'),
        ("json", '{"properties": {"a": {}}}', "json", PROPERTIES_CLOSED),  # as kvbaton's grammar
        ("regex", "[ab]+", "regex", "[ab]+"),
        ("choice", json.dumps(["yes", "no"]), "choice", ["yes", "no"]),
        ("grammar", 'start: "x"', "grammar", 'start: "x"'),
    ],
)
def test_constraints_map_to_structured_outputs(
    kind: str, spec: str, field: str, value: object
) -> None:
    ours = vllm_sampling_params(SamplingParams(guided=Guided(kind=kind, spec=spec)).validate())
    assert getattr(ours.structured_outputs, field) == value


def test_a_replayed_constraint_goes_to_kvbaton_s_logits_processor() -> None:
    guided = Guided(kind="regex", spec="a+", replay=2)
    ours = vllm_sampling_params(SamplingParams(guided=guided).validate(), {"k": 1})
    assert ours.structured_outputs is None  # vLLM's grammar would start over
    assert ours.extra_args == {
        REPLAYED_CONSTRAINT: {"kind": "regex", "spec": "a+", "replay": 2},
        "kv_transfer_params": {"k": 1},
    }


def test_a_required_thinking_budget_is_refused_another_goes_unenforced() -> None:
    """vLLM places no token: chat's budget is refused, Anthropic's goes on without it."""
    with pytest.raises(ValueError, match="thinking budgets are enforced by kvbaton's own"):
        vllm_sampling_params(SamplingParams(thinking_budget=ThinkingBudget(tokens=3, end=9)))
    soft = ThinkingBudget(tokens=3, end=9, required=False)
    ours = vllm_sampling_params(SamplingParams(max_tokens=5, thinking_budget=soft))
    assert ours.max_tokens == 5 and ours.extra_args is None


@dataclass
class _Logprob:
    logprob: float
    rank: int


def test_logprobs_are_the_chosen_one_then_the_best_by_rank() -> None:
    step = {7: _Logprob(-2.0, 3), 1: _Logprob(-0.1, 1), 2: _Logprob(-1.0, 2)}
    assert token_logprobs([7], [step], 2) == [
        [TokenLogprob(7, -2.0, 3), TokenLogprob(1, -0.1), TokenLogprob(2, -1.0)]
    ]  # the chosen one with its rank
    assert token_logprobs([7], [step], 0) == [[TokenLogprob(7, -2.0, 3)]]
    assert token_logprobs([7], None, 2) is None
