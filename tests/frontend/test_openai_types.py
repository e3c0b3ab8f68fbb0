"""The request bodies without a server: each bad content part is refused with an error that
names the part and its fault; a null stands for a field's default where the field takes none."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from kvbaton.frontend import openai_types
from kvbaton.frontend.errors import from_validation_errors
from kvbaton.frontend.openai_types import ChatCompletionRequest, CompletionRequest

TEXT = {"type": "text", "text": "hi"}


def refusal(content: Any) -> tuple[str, str | None]:
    """(message, param) of the 400 that a user message with `content` gets."""
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate(body)
    error = from_validation_errors(refused.value.errors())
    return error.message, error.param


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ([{"text": "hi"}], ["part 0", "'type'", "required"]),
        ([TEXT, "hi"], ["part 1", "dictionary"]),
        ([7], ["part 0", "dictionary"]),
        ([{"type": "text"}], ["part 0", "'text'", "required"]),
        ([{"type": "text", "text": 3}], ["part 0", "'text'", "string"]),
        ([TEXT, TEXT | {"x": 1}], ["part 1", "'x'", "not permitted"]),
        ([{"type": "image_url"}], ["'image_url'", "text parts only"]),
    ],
)
def test_a_bad_content_part_is_named_with_its_fault(content: Any, named: list[str]) -> None:
    message, param = refusal(content)
    assert param == "messages.0.content"
    for words in named:
        assert words in message, message


def test_text_parts_are_joined() -> None:
    parts = [TEXT, {"type": "text", "text": " there"}]
    body = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    assert ChatCompletionRequest.model_validate(body).messages[0].text() == "hi there"


def test_a_null_stands_for_the_default_of_a_field_that_takes_none() -> None:
    nulls = dict.fromkeys(("n", "stream", "ignore_eos", "min_tokens", "stream_options"))
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    chat = ChatCompletionRequest.model_validate(
        base | nulls | {"logprobs": None, "parallel_tool_calls": None}
    )
    assert chat == ChatCompletionRequest.model_validate(base)
    usage = {"include_usage": None, "continuous_usage_stats": None}
    streamed = ChatCompletionRequest.model_validate(
        base | {"stream": True, "stream_options": usage}
    )
    assert streamed.stream_options is not None and not streamed.include_usage
    text = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "echo": None} | nulls)
    assert text.n == 1 and not text.echo and text.max_tokens == 16


@pytest.mark.parametrize(
    "body",
    [
        {"model": None, "messages": [{"role": "user", "content": "hi"}]},
        {"model": "m", "messages": None},
        {"model": "m", "messages": [{"role": None, "content": "hi"}]},
    ],
)
def test_a_null_for_a_required_field_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_every_body_with_a_field_that_takes_no_null_takes_one_as_its_default() -> None:
    bodies = [
        body
        for _, body in inspect.getmembers(openai_types, inspect.isclass)
        if issubclass(body, BaseModel) and openai_types.defaulted_on_null(body)
    ]
    assert ChatCompletionRequest in bodies and openai_types.StreamOptions in bodies
    for body in bodies:
        assert issubclass(body, openai_types._NullIsDefault), body.__name__
