"""How a chat request's `thinking_token_budget` becomes the engine's `ThinkingBudget` (no
server): the tags as token ids where each is one token, nothing where the answer has no
reasoning, a 400 (chat's) or nothing (Anthropic's) where it cannot be enforced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvbaton.frontend.errors import OpenAIError
from kvbaton.frontend.messages_api import _CutChatRequest
from kvbaton.frontend.openai_types import ChatCompletionRequest
from kvbaton.frontend.preprocess import thinking_budget
from kvbaton.frontend.reasoning import REASONING_FORMATS
from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.protocols.llm import ThinkingBudget
from tests.tiny_models import build_chat_model

pytestmark = pytest.mark.unit

R1, QWEN3 = REASONING_FORMATS["deepseek-r1"], REASONING_FORMATS["qwen3"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("models") / "tiny-think"
    return Tokenizer(build_chat_model(path, added_tokens=["<think>", "</think>"]))


def tags(tokenizer: Tokenizer) -> tuple[int, int]:
    """The ids of `<think>` and `</think>`."""
    opening, closing = (
        tokenizer.encode(t, add_special_tokens=False) for t in ("<think>", "</think>")
    )
    return opening[0], closing[0]


def chat(
    budget: int | None, kind: type[ChatCompletionRequest] = ChatCompletionRequest, **more: Any
) -> ChatCompletionRequest:
    messages = more.pop("messages", [{"role": "user", "content": "Why?"}])
    body = {"model": "m", "messages": messages, "thinking_token_budget": budget, **more}
    return kind.model_validate(body)


def test_the_tags_go_as_single_token_ids(tokenizer: Tokenizer) -> None:
    opening, closing = tags(tokenizer)
    prompt = [5, opening, 6]  # the template opened the reasoning
    assert thinking_budget(chat(5), R1, tokenizer, prompt) == ThinkingBudget(tokens=5, end=closing)
    assert thinking_budget(chat(5), QWEN3, tokenizer, [5]) == ThinkingBudget(
        tokens=5, end=closing, start=opening
    )
    soft = thinking_budget(chat(5, _CutChatRequest), R1, tokenizer, prompt)
    assert soft == ThinkingBudget(tokens=5, end=closing, required=False)


def test_an_answer_without_reasoning_gets_no_budget(tokenizer: Tokenizer) -> None:
    opening, closing = tags(tokenizer)
    assert thinking_budget(chat(None), R1, tokenizer, [5]) is None
    assert thinking_budget(chat(-1), R1, tokenizer, [5]) is None  # vLLM's "no budget"
    closed = [5, opening, 6, closing, 7]  # the template switched the thinking off
    assert thinking_budget(chat(5), R1, tokenizer, closed) is None
    quoted = [5, opening, 6, closing, 7, 8, 9, 10, opening]  # tags in a message, then opened
    assert thinking_budget(chat(5), R1, tokenizer, quoted) == ThinkingBudget(tokens=5, end=closing)
    done = [
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "<think>so</think>Be"},
    ]
    answered = chat(5, messages=done, continue_final_message=True)
    assert thinking_budget(answered, QWEN3, tokenizer, [5]) is None
    open_ = [done[0], {"role": "assistant", "content": "<think>so"}]
    going_on = chat(5, messages=open_, continue_final_message=True)
    assert thinking_budget(going_on, QWEN3, tokenizer, [5]) == ThinkingBudget(tokens=5, end=closing)


def test_where_it_cannot_be_enforced_chat_refuses_it(
    tokenizer: Tokenizer, chat_model: Path
) -> None:
    split_tags = Tokenizer(chat_model)  # "</think>" is several tokens there
    for fmt, tok, why in (
        (None, tokenizer, "--reasoning-parser"),
        (R1, split_tags, "single tokens"),
    ):
        with pytest.raises(OpenAIError) as refused:
            thinking_budget(chat(5), fmt, tok, [5])
        assert refused.value.status == 400 and refused.value.param == "thinking_token_budget"
        assert why in refused.value.message
        assert thinking_budget(chat(5, _CutChatRequest), fmt, tok, [5]) is None


def test_bad_budgets_are_refused_as_fields() -> None:
    for bad in (-2, True, "5", 1.5):
        with pytest.raises(ValidationError, match="thinking_token_budget"):
            chat(bad)  # type: ignore[arg-type]
