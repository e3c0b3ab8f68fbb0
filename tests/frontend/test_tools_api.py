"""Tool calling through the official `openai` client, against a real `kvbaton serve`: a tiny
random-weight model whose chat template takes tools (its forced calls are valid by
construction, or not at all), and a fixed-output worker whose answer carries a call in the
Hermes format (parsed out of the content, whole and streamed). Every bad input: a 400 naming
its field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from kvbaton.llm.tokenizer import Tokenizer
from tests.frontend.conftest import Deployment, start_serve, stop_cleanly
from tests.tiny_models import TOOLS_TEMPLATE, build_chat_model

pytestmark = pytest.mark.integration

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
FIXED_ANSWER = (
    'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(
        tmp_path_factory.mktemp("models") / "tiny-tools", template=TOOLS_TEMPLATE
    )


def _client(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tiny(tools_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = start_serve(tools_model, tmp_path_factory.mktemp("discovery"))
    yield deployment
    stop_cleanly(deployment)


@pytest.fixture(scope="module")
def fixed(tools_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    ids = Tokenizer(tools_model).encode(FIXED_ANSWER, add_special_tokens=False)
    tokens = ",".join(map(str, ids))
    deployment = start_serve(
        tools_model,
        tmp_path_factory.mktemp("discovery"),
        "--engine",
        "fixed",
        "--fixed-tokens",
        tokens,
    )
    yield deployment
    stop_cleanly(deployment)


def _valid(call: Any) -> None:
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_are_valid_for_each_prompt(tiny: Deployment) -> None:
    client = _client(tiny)
    for seed in range(10):
        answer = client.chat.completions.create(
            model=tiny.model,
            messages=[{"role": "user", "content": f"Question {seed}: weather or a sum?"}],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            seed=seed,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        _valid(call)


def test_a_named_call_calls_that_function(tiny: Deployment) -> None:
    client = _client(tiny)
    for seed in range(5):
        answer = client.chat.completions.create(
            model=tiny.model,
            messages=USER,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "add"}},
            max_tokens=120,
            seed=seed,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop"  # as OpenAI's for a named function
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "add"
        _valid(call)


def test_a_streamed_call_announces_then_streams_its_arguments(tiny: Deployment) -> None:
    client = _client(tiny)
    asked: dict[str, Any] = {
        "model": tiny.model,
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 120,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**asked).choices[0]
    chunks = [c for c in client.chat.completions.create(**asked, stream=True) if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    head, *fragments = deltas
    assert (head.index, head.type, head.function and head.function.arguments) == (0, "function", "")
    assert head.id and head.function and head.function.name
    assert fragments  # one per output read (several outputs read together are one: issue 32)
    assert all(d.id is None and d.function and d.function.name is None for d in fragments)
    arguments = "".join(d.function.arguments or "" for d in fragments if d.function)
    (call,) = whole.message.tool_calls or []
    assert (head.function.name, arguments) == (call.function.name, call.function.arguments)
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_no_tools_render_the_same_prompt(tiny: Deployment) -> None:
    client = _client(tiny)
    plain = client.chat.completions.create(model=tiny.model, messages=USER, max_tokens=4)
    none = client.chat.completions.create(
        model=tiny.model,
        messages=USER,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=4,  # type: ignore[arg-type]
    )
    offered = client.chat.completions.create(
        model=tiny.model,
        messages=USER,
        tools=TOOLS,
        max_tokens=4,  # type: ignore[arg-type]
    )
    assert plain.usage and none.usage and offered.usage
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens  # the template shows them
    assert none.choices[0].message.tool_calls is None


def test_a_conversation_with_a_tool_result(tiny: Deployment) -> None:
    client = _client(tiny)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
    }
    history: list[Any] = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    answer = client.chat.completions.create(
        model=tiny.model,
        messages=history,
        tools=TOOLS,
        max_tokens=4,  # type: ignore[arg-type]
    )
    shorter = client.chat.completions.create(
        model=tiny.model,
        messages=history[:1],
        tools=TOOLS,
        max_tokens=4,  # type: ignore[arg-type]
    )
    assert answer.usage and shorter.usage
    assert answer.usage.prompt_tokens > shorter.usage.prompt_tokens + 20  # the call and result


def test_an_offered_call_is_parsed_out_of_the_content(fixed: Deployment, tools_model: Path) -> None:
    client = _client(fixed)
    length = len(Tokenizer(tools_model).encode(FIXED_ANSWER, add_special_tokens=False))
    asked: dict[str, Any] = {
        "model": fixed.model,
        "messages": USER,
        "tools": TOOLS,
        "max_tokens": length,  # the fixed answer once
    }
    message = client.chat.completions.create(**asked).choices[0].message
    assert message.content == "Checking."
    (call,) = message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    chunks = [c for c in client.chat.completions.create(**asked, stream=True) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert content == "Checking."
    assert [d.function.name for d in deltas if d.id] == ["get_weather"]  # type: ignore[union-attr]
    assert json.loads(arguments) == {"city": "Paris"}
    plain = client.chat.completions.create(model=fixed.model, messages=USER, max_tokens=length)
    assert plain.choices[0].message.content == FIXED_ANSWER  # no tools: all of it is content


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
            ]
        },
        "tools",
    ),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "perhaps"}, "parallel_tool_calls"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    ({"tools": TOOLS, "tool_choice": "required", "min_tokens": 2}, "min_tokens"),
    ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages"),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                }
            ]
        },
        "messages",
    ),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_tool_input_is_a_400_naming_its_field(
    tiny: Deployment, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _client(tiny).chat.completions.create(
            model=tiny.model, messages=USER, max_tokens=4, extra_body=extra
        )
    assert info.value.status_code == 400
    error = info.value.body
    assert isinstance(error, dict)
    assert str(error.get("param")).startswith(param), error
