"""Thinking budgets: once the reasoning holds its budget's tokens, the engine places the closing
tag's tokens itself; the reasoning before is what the model drew. On a random-weight model, and
on the budget's state alone (tokens generated elsewhere, an opening tag, a reasoning that ended
early)."""

from __future__ import annotations

import pytest

from kvbaton.engine import EngineConfig, LLMEngine
from kvbaton.engine.connector import EngineRequest
from kvbaton.engine.thinking_budget import ThinkingState
from kvbaton.protocols.llm import Guided, SamplingParams, ThinkingBudget
from tests.engine.conftest import TEST_DEVICE
from tests.tiny_models import build_chat_model

pytestmark = pytest.mark.unit

END = 7  # the closing tag's id
PROMPT = [5, 6, 11, 12]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    model = build_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")
    config = EngineConfig(model=str(model), dtype="float32", device=TEST_DEVICE, num_kv_blocks=64)
    return LLMEngine(config)


def run(engine: LLMEngine, *requests: EngineRequest) -> dict[str, list[int]]:
    """Each request's output tokens, the requests run together."""
    outputs: dict[str, list[int]] = {}
    for request in requests:
        engine.add_request(request)
        outputs[request.request_id] = []
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
    return outputs


def budgeted(budget: ThinkingBudget | None, **params: object) -> SamplingParams:
    base: dict[str, object] = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    return SamplingParams(**(base | params), thinking_budget=budget)  # type: ignore[arg-type]


def test_the_closing_tag_is_placed_once_the_budget_is_spent(engine: LLMEngine) -> None:
    free = run(engine, EngineRequest("free", PROMPT, budgeted(None)))["free"]
    for tokens in (0, 1, 4):
        budget = ThinkingBudget(tokens=tokens, end=END)
        out = run(engine, EngineRequest(f"b{tokens}", PROMPT, budgeted(budget)))[f"b{tokens}"]
        assert out[:tokens] == free[:tokens]  # the reasoning: the model's own
        assert out[tokens] == END
        assert len(out) == 12  # the answer goes on after it


def test_sampled_rows_in_a_batch_keep_their_own_draws(engine: LLMEngine) -> None:
    """A seeded request with a budget draws as one without: its reasoning is the same."""
    seeded = {"temperature": 1.0, "seed": 7}
    budget = ThinkingBudget(tokens=3, end=END)
    out = run(
        engine,
        EngineRequest("free", PROMPT, budgeted(None, **seeded)),
        EngineRequest("budget", PROMPT, budgeted(budget, **seeded)),
        EngineRequest("other", [9, 10], budgeted(None)),
    )
    assert out["budget"][:3] == out["free"][:3] and out["budget"][3] == END


def test_a_migrated_requests_reasoning_counts_from_its_prompt(engine: LLMEngine) -> None:
    """Two reasoning tokens were generated before (the prompt's tail, replayed): one more."""
    budget = ThinkingBudget(tokens=3, end=END, replay=2)
    out = run(engine, EngineRequest("m", [*PROMPT, 30, 31], budgeted(budget)))["m"]
    assert out[1] == END
    with pytest.raises(ValueError, match="replays more tokens"):
        engine.add_request(
            EngineRequest("x", [5], budgeted(ThinkingBudget(tokens=1, end=END, replay=2)))
        )


def test_bad_budgets_are_refused(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="tokens must be at least 0"):
        budgeted(ThinkingBudget(tokens=-1, end=END)).validate()
    with pytest.raises(ValueError, match="cannot go with a constraint"):
        SamplingParams(
            thinking_budget=ThinkingBudget(tokens=1, end=END), guided=Guided(kind="regex", spec="a")
        ).validate()
    with pytest.raises(ValueError, match="token ids in"):
        engine.add_request(
            EngineRequest("x", PROMPT, budgeted(ThinkingBudget(tokens=1, end=10**7)))
        )


def placed_after(state: ThinkingState, generated: list[int]) -> int | None:
    """What the state places after `generated` (looked at as grown one token at a time)."""
    tokens = [1, 2]  # a prompt
    placed = state.placed(tokens, len(tokens))
    for token in generated:
        tokens.append(token)
        placed = state.placed(tokens, 2)
    return placed


def test_a_reasoning_that_ended_early_gets_nothing_placed() -> None:
    assert placed_after(ThinkingState(ThinkingBudget(tokens=4, end=END)), [40, END]) is None
    assert (
        placed_after(ThinkingState(ThinkingBudget(tokens=4, end=END)), [40, END, 41, 42, 43])
        is None
    )
    assert placed_after(ThinkingState(ThinkingBudget(tokens=4, end=END)), [40, 41]) is None


def test_with_an_opening_tag_the_reasoning_starts_after_it() -> None:
    budget = ThinkingBudget(tokens=2, end=END, start=3)
    assert placed_after(ThinkingState(budget), [3, 50]) is None
    assert placed_after(ThinkingState(budget), [3, 50, 51]) == END
    assert placed_after(ThinkingState(budget), [3, 50, 51, END, 52]) is None
    assert placed_after(ThinkingState(budget), [50, 51, 52, 53]) is None  # opened otherwise


def test_tokens_generated_elsewhere_are_taken_at_once() -> None:
    """A prefill worker's tokens, or a resumed stream's, arrive before the first draw here;
    reasoning already past its budget (an engine that did not enforce it) is closed at once."""
    state = ThinkingState(ThinkingBudget(tokens=2, end=END))
    assert state.placed([1, 2, 60, 61, 62, 63], 2) == END
    assert state.placed([1, 2, 60, 61, 62, 63, END], 2) is None  # the reasoning is over
    assert state.placed([1, 2, 60, 61, 62, 63, END, 64], 2) is None
