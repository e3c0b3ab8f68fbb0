"""The sampler's logit bias: added to a row's logits before the pick, never to its logprobs,
and only to the rows that ask for it."""

from __future__ import annotations

import pytest
import torch

from kvbaton.engine.sampler import Sampler
from kvbaton.engine.sequence import Sequence
from kvbaton.protocols.llm import SamplingParams

pytestmark = pytest.mark.unit

LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])


def sequence(name: str, **params: object) -> Sequence:
    return Sequence(name, [0, 1], SamplingParams(temperature=0, **params))  # type: ignore[arg-type]


def test_a_bias_moves_the_pick_of_its_row_only() -> None:
    sampler = Sampler(0, torch.device("cpu"))
    favoured, plain = sequence("f", logit_bias={2: 100.0}), sequence("p")
    assert sampler(LOGITS, [favoured, plain]) == [2, 1]
    banned = sequence("b", logit_bias={1: -100.0, 3: -100.0})
    assert sampler(LOGITS[:1], [banned]) == [2]


def test_a_bias_leaves_the_logprobs_raw() -> None:
    sampler = Sampler(0, torch.device("cpu"))
    seq = sequence("f", logit_bias={0: 100.0}, logprobs=0)
    assert sampler(LOGITS[:1], [seq]) == [0]
    (entry,) = seq.logprobs
    assert entry[0].token_id == 0
    assert entry[0].logprob == pytest.approx(float(torch.log_softmax(LOGITS[0], -1)[0]))


def test_a_bias_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 100.5}).validate()
