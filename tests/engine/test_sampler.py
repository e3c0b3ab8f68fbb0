"""The sampler's logit bias: added to a row's logits before the pick, never to its logprobs,
and only to the rows that ask for it; each row's logprobs with its own number of alternatives."""

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


def test_rows_of_one_step_get_their_own_number_of_alternatives() -> None:
    sampler = Sampler(0, torch.device("cpu"))
    rows = [sequence("n", logprobs=None), sequence("a", logprobs=0), sequence("b", logprobs=3)]
    assert sampler(torch.cat([LOGITS, LOGITS[:1]]), rows) == [1, 1, 1]
    assert rows[0].logprobs == []
    (only,), (ranked,) = rows[1].logprobs, rows[2].logprobs
    expected = torch.log_softmax(LOGITS[0], -1)
    assert [e.token_id for e in only] == [1]
    assert [e.token_id for e in ranked] == [1, 1, 3, 2]  # the chosen one, then the best 3
    assert [e.logprob for e in ranked] == pytest.approx(expected[[1, 1, 3, 2]].tolist())
