"""A chat request's template inputs without a server: `chat_template_kwargs` and
`reasoning_effort` reach the template, `add_generation_prompt` and `continue_final_message`
shape the prompt's end (as vLLM's fields), and the names the server sets itself are refused with
a 400 naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvbaton.frontend.errors import OpenAIError
from kvbaton.frontend.openai_types import ChatCompletionRequest
from kvbaton.frontend.preprocess import prompt_token_ids
from kvbaton.llm.tokenizer import Tokenizer
from tests.tiny_models import CHATML_TEMPLATE, build_chat_model

# ChatML with Qwen3's switch: an empty reasoning block opens the answer when thinking is off;
# and the reasoning effort, when given, written first.
THINKING_TEMPLATE = (
    "{% if reasoning_effort is defined %}<effort:{{ reasoning_effort }}>{% endif %}"
    + CHATML_TEMPLATE
    + (
        "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}"
    )
)
ASKED = [{"role": "user", "content": "The capital of France?"}]
STARTED = [*ASKED, {"role": "assistant", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("models") / "thinking"
    return Tokenizer(build_chat_model(path, template=THINKING_TEMPLATE))


def prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], **fields: Any) -> str:
    body = {"model": "m", "messages": messages} | fields
    (ids,) = prompt_token_ids(tokenizer, ChatCompletionRequest.model_validate(body))
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_template_kwargs_reach_the_template(tokenizer: Tokenizer) -> None:
    thinking_off = prompt(tokenizer, ASKED, chat_template_kwargs={"enable_thinking": False})
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt(tokenizer, ASKED).endswith("<|im_start|>assistant\n")
    on = prompt(tokenizer, ASKED, chat_template_kwargs={"enable_thinking": True})
    assert on == prompt(tokenizer, ASKED)


def test_reasoning_effort_reaches_the_template_and_switches_thinking(tokenizer: Tokenizer) -> None:
    off = prompt(tokenizer, ASKED, reasoning_effort="none")
    assert off.startswith("<effort:none>")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    high = prompt(tokenizer, ASKED, reasoning_effort="high")
    assert high == "<effort:high>" + prompt(tokenizer, ASKED)
    # The template's own switch, where the request sets it, wins.
    kept = prompt(
        tokenizer, ASKED, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}
    )
    assert kept == "<effort:none>" + prompt(tokenizer, ASKED)


def test_an_unknown_reasoning_effort_is_refused() -> None:
    with pytest.raises(ValidationError, match="reasoning_effort"):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": ASKED, "reasoning_effort": "extreme"}
        )


def test_a_final_message_is_continued_without_its_end_of_turn(tokenizer: Tokenizer) -> None:
    continued = prompt(tokenizer, STARTED, continue_final_message=True)
    assert continued.endswith("<|im_start|>assistant\nThe capital of France is")
    explicit = prompt(tokenizer, STARTED, continue_final_message=True, add_generation_prompt=False)
    assert explicit == continued


def test_without_a_generation_prompt_the_prompt_ends_with_the_last_turn(
    tokenizer: Tokenizer,
) -> None:
    assert prompt(tokenizer, ASKED, add_generation_prompt=False).endswith(
        "The capital of France?<|im_end|>\n"
    )


@pytest.mark.parametrize("name", ["messages", "tools", "add_generation_prompt", "tokenize"])
def test_names_the_server_sets_are_refused(tokenizer: Tokenizer, name: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        prompt(tokenizer, ASKED, chat_template_kwargs={name: 1})
    assert refused.value.status == 400
    assert refused.value.param == "chat_template_kwargs"
    assert name in refused.value.message


def test_continuing_and_opening_a_new_turn_at_once_is_refused() -> None:
    body = {"model": "m", "messages": STARTED, "continue_final_message": True}
    with pytest.raises(ValidationError, match="cannot both be true"):
        ChatCompletionRequest.model_validate(body | {"add_generation_prompt": True})


def test_a_final_message_the_template_does_not_write_cannot_be_continued(
    tmp_path: Path,
) -> None:
    shouting = CHATML_TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] | upper }}")
    tokenizer = Tokenizer(build_chat_model(tmp_path / "shouting", template=shouting))
    with pytest.raises(OpenAIError) as refused:
        prompt(tokenizer, STARTED, continue_final_message=True)
    assert refused.value.status == 400 and refused.value.param == "messages"
