"""A chat request's tools without a server: the prompt a template that takes no tools gets
(the default tool prompt, the history's calls and results in the format's text), what one that
takes tools gets, and the forced call's grammar in each format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvbaton.frontend.openai_types import ChatCompletionRequest
from kvbaton.frontend.tool_calls import TOOL_CALL_FORMATS
from kvbaton.frontend.tools import template_inputs, tool_use
from kvbaton.llm.tokenizer import Tokenizer
from tests.frontend.grammar_helpers import grammar_check

ADD: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
HISTORY: list[Any] = [
    {"role": "user", "content": "1 + 2?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
]


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY} | fields)


def test_a_template_without_tools_gets_the_default_prompt_and_text_calls() -> None:
    fmt = TOOL_CALL_FORMATS["hermes"]
    asked = request(tools=[ADD])
    messages, tools = template_inputs(asked, fmt, tool_use(asked, fmt), takes_tools=False)
    assert tools is None
    system, user, assistant, result = messages
    assert system["role"] == "system" and json.dumps(ADD) in system["content"]
    assert '<tool_call>\n{"name": "NAME", "arguments": {"ARGUMENT": "VALUE"}}' in system["content"]
    assert user == {"role": "user", "content": "1 + 2?"}
    assert (
        assistant["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    )
    assert result == {"role": "tool", "content": "<tool_response>\n3\n</tool_response>"}


def test_the_default_prompt_joins_a_system_message() -> None:
    fmt = TOOL_CALL_FORMATS["hermes"]
    asked = request(messages=[{"role": "system", "content": "Be brief."}, *HISTORY], tools=[ADD])
    messages, _ = template_inputs(asked, fmt, tool_use(asked, fmt), takes_tools=False)
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call functions")
    assert len(messages) == 4


def test_a_template_with_tools_gets_them_and_structured_calls() -> None:
    fmt = TOOL_CALL_FORMATS["hermes"]
    asked = request(tools=[ADD], tool_choice="none")
    messages, tools = template_inputs(asked, fmt, tool_use(asked, fmt), takes_tools=True)
    assert tools is None  # tool_choice none: not shown
    asked = request(tools=[ADD])
    messages, tools = template_inputs(asked, fmt, tool_use(asked, fmt), takes_tools=True)
    assert tools == [ADD]
    assert messages[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    ]
    assert messages[2] == {"role": "tool", "content": "3", "tool_call_id": "call_1"}


def test_history_renders_through_a_real_template(chat_model: Path) -> None:
    tokenizer = Tokenizer(chat_model)
    fmt = TOOL_CALL_FORMATS["hermes"]
    asked = request()
    messages, tools = template_inputs(asked, fmt, None, tokenizer.takes_tools)
    text = tokenizer.decode(tokenizer.apply_chat_template(messages, tools=tools))
    assert "<tool_call>" in text and "<tool_response>\n3\n</tool_response>" in text


@pytest.mark.parametrize("name", sorted(TOOL_CALL_FORMATS))
def test_the_forced_grammar_takes_a_valid_call_only(name: str, chat_model: Path) -> None:
    fmt = TOOL_CALL_FORMATS[name]
    asked = request(tools=[ADD], tool_choice="required")
    use = tool_use(asked, fmt)
    assert use is not None
    guided = use.guided
    assert guided is not None
    check = grammar_check(chat_model)

    def takes(text: str) -> bool:
        return check(guided, text)

    compact = json.dumps({"name": "add", fmt.args_key: {"a": 1, "b": 2}}, separators=(",", ":"))
    written = fmt.before + fmt.call.replace("{call}", compact) + fmt.after
    assert takes(written)
    assert takes(
        fmt.before + fmt.between.join([fmt.call.replace("{call}", compact)] * 2) + fmt.after
    )
    assert not takes(written.replace('"b":2', '"b":"2"'))
    assert not takes(written.replace('"add"', '"sub"'))
    assert not takes(written.replace('"b":2', '"b":2,"c":3'))  # no invented argument
