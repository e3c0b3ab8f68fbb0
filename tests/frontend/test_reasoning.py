"""The reasoning splitter on its own (whole answers, every cut into two pieces, the formats'
differences) and inside a choice's postprocessing (token by token, stop strings, finish
reasons) with a real byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbaton.frontend.postprocess import ChoiceState
from kvbaton.frontend.reasoning import (
    REASONING_FORMATS,
    ReasoningFormat,
    ReasoningSplitter,
    Split,
    split_reasoning,
)
from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.protocols.llm import EngineOutput

pytestmark = pytest.mark.unit

R1 = REASONING_FORMATS["deepseek-r1"]
QWEN3 = REASONING_FORMATS["qwen3"]
BOTH = pytest.mark.parametrize("fmt", [R1, QWEN3], ids=["deepseek-r1", "qwen3"])


def fed(splitter: ReasoningSplitter, pieces: list[str]) -> Split:
    """All pieces fed (the last as final), the parts joined."""
    parts = [splitter.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return Split("".join(p.reasoning for p in parts), "".join(p.content for p in parts))


@BOTH
def test_a_whole_answer_with_both_tags(fmt: ReasoningFormat) -> None:
    answer = "<think>plan it</think>\n\nthe answer"
    assert split_reasoning(fmt, answer) == Split("plan it", "\n\nthe answer")


TEXTS = [
    "<think>plan</think>answer",
    "<think>a < b, </thin not yet</think>x</think> <think>y",
    "<think></think>",
    "<thinking>not a tag",
    "<think>never closed <",
    "no tags at all </",
    "<thi",
    "",
]


@BOTH
@pytest.mark.parametrize("text", TEXTS)
def test_every_cut_into_two_pieces_gives_the_whole_answers_parts(
    fmt: ReasoningFormat, text: str
) -> None:
    whole = split_reasoning(fmt, text)
    for cut in range(len(text) + 1):
        splitter = ReasoningSplitter(fmt)
        assert fed(splitter, [text[:cut], text[cut:]]) == whole, cut


@BOTH
@pytest.mark.parametrize("text", TEXTS)
def test_one_character_at_a_time_gives_the_whole_answers_parts(
    fmt: ReasoningFormat, text: str
) -> None:
    whole = split_reasoning(fmt, text)
    assert fed(ReasoningSplitter(fmt), [*text, ""]) == whole


def test_the_parts_of_answers_with_odd_tags() -> None:
    assert split_reasoning(QWEN3, TEXTS[1]) == Split("a < b, </thin not yet", "x</think> <think>y")
    assert split_reasoning(QWEN3, "<think></think>") == Split("", "")
    assert split_reasoning(QWEN3, "<thinking>not a tag") == Split("", "<thinking>not a tag")
    assert split_reasoning(R1, "<thinking>not a tag") == Split("<thinking>not a tag", "")


def test_deepseek_r1_starts_inside_the_reasoning_without_the_opening_tag() -> None:
    assert split_reasoning(R1, "plan</think>answer") == Split("plan", "answer")
    # Qwen3 opens its reasoning itself: without the tag there is none.
    assert split_reasoning(QWEN3, "plan</think>answer") == Split("", "plan</think>answer")


def test_without_tags_deepseek_r1_is_all_reasoning_and_qwen3_all_content() -> None:
    assert split_reasoning(R1, "just words") == Split("just words", "")
    assert split_reasoning(QWEN3, "just words") == Split("", "just words")


@BOTH
def test_reasoning_unterminated_at_the_end_is_reasoning(fmt: ReasoningFormat) -> None:
    splitter = ReasoningSplitter(fmt)
    assert splitter.feed("<think>still going </th") == Split("still going ", "")
    assert splitter.feed("", final=True) == Split("</th", "")


@BOTH
def test_an_answer_continuing_open_reasoning_starts_inside_it(fmt: ReasoningFormat) -> None:
    splitter = ReasoningSplitter(fmt, continued="<think>done</think> and <think>First,")
    assert fed(splitter, [" then</thi", "nk>answer"]) == Split(" then", "answer")


@BOTH
@pytest.mark.parametrize("continued", ["<think>plan</think>So:", "The answer is", ""])
def test_an_answer_continuing_no_open_reasoning_is_all_content(
    fmt: ReasoningFormat, continued: str
) -> None:
    answer = "<think>x</think> 42"
    assert fed(ReasoningSplitter(fmt, continued), ["<th", answer[3:]]) == Split("", answer)


def test_only_a_possible_tag_prefix_is_held_back() -> None:
    splitter = ReasoningSplitter(QWEN3)
    assert splitter.feed("<th") == Split("", "")  # may open the reasoning
    assert splitter.feed("ink>step one, a <") == Split("step one, a ", "")
    assert splitter.feed("b </") == Split("<b ", "")
    assert splitter.feed("think>") == Split("", "")
    assert splitter.feed("ans") == Split("", "ans")  # in the content, nothing is held
    assert splitter.feed("wer </") == Split("", "wer </")


# -- inside a choice's postprocessing ------------------------------------------------------------
ANSWER = "<think>plan the reply</think>Hello there, France!"


@pytest.fixture(scope="module")
def tokenizer(chat_model: Path) -> Tokenizer:
    return Tokenizer(chat_model)


def run_choice(
    tokenizer: Tokenizer, text: str, stops: list[str], max_tokens: int | None = None
) -> tuple[str, str, str | None, int]:
    """`text`'s tokens through a choice one output per token, ending "length" after the last
    (or `max_tokens`); (reasoning, content, finish reason, outputs with text)."""
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    assert len(ids) > 8  # the tags span tokens, the text comes in many pieces
    state = ChoiceState(tokenizer, [1, 2, 3], stops, QWEN3)
    reasoning, content, pieces = [], [], 0
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        out = EngineOutput(
            request_id="r", token_ids=[token], finish_reason="length" if last else None
        )
        delta = state.update(out)
        reasoning.append(delta.reasoning)
        content.append(delta.text)
        pieces += bool(delta.reasoning or delta.text)
        assert "<think>" not in delta.text and "</think>" not in delta.text
        if state.finished:
            break
    return "".join(reasoning), "".join(content), state.finish_reason, pieces


def test_a_choice_streamed_token_by_token_splits_as_the_whole_answer(tokenizer: Tokenizer) -> None:
    reasoning, content, finish, pieces = run_choice(tokenizer, ANSWER, [])
    assert (reasoning, content, finish) == ("plan the reply", "Hello there, France!", "length")
    assert pieces > 4


def test_stop_strings_apply_to_the_whole_text_reasoning_included(tokenizer: Tokenizer) -> None:
    assert run_choice(tokenizer, ANSWER, ["there"])[:3] == ("plan the reply", "Hello ", "stop")
    assert run_choice(tokenizer, ANSWER, ["the r"])[:3] == ("plan ", "", "stop")
    assert run_choice(tokenizer, ANSWER, ["</think>"])[:3] == ("plan the reply", "", "stop")


def test_an_answer_cut_by_max_tokens_inside_the_reasoning(tokenizer: Tokenizer) -> None:
    cut = tokenizer.decode(tokenizer.encode(ANSWER, add_special_tokens=False)[:12])
    assert cut.startswith("<think>plan") and "</think>" not in cut
    reasoning, content, finish, _ = run_choice(tokenizer, ANSWER, [], 12)
    assert (reasoning, content, finish) == (cut.removeprefix("<think>"), "", "length")
