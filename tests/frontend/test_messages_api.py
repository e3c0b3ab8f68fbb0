"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) of a real `kvbaton
serve`, through the official `anthropic` client: each message is the chat answer of the same
conversation, whole and streamed as Anthropic's events; tool use and tool results; stop
sequences; a prefilled answer; token counts; errors in Anthropic's shape."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.frontend.conftest import Deployment
from tests.helpers import ADD_PARAMETERS, CITY_SCHEMA

pytestmark = pytest.mark.integration

ADD = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": ADD_PARAMETERS,
}
CONVERSATION: list[Any] = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Paris."}]},
    {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]},
]
GREEDY = {"temperature": 0}  # as older clients send it (this SDK's create takes none)
CHAT: list[Any] = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def clients(deployment: Deployment) -> tuple[anthropic.Anthropic, openai.OpenAI]:
    return (
        anthropic.Anthropic(base_url=deployment.url, api_key="none", max_retries=0),
        openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="none", max_retries=0),
    )


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_message_is_the_chat_answer_of_its_conversation(served: Deployment) -> None:
    """System, turns and limit give the chat answer of the same messages: its text, its
    usage (the prompt split into uncached and cached tokens), the stop reason."""
    claude, chat_client = clients(served)
    for limit in (3, 40):
        chat = chat_client.chat.completions.create(
            model=served.model, messages=CHAT, max_tokens=limit, temperature=0
        )
        message = claude.messages.create(
            model=served.model,
            system="Be terse.",
            messages=CONVERSATION,
            max_tokens=limit,
            extra_body=GREEDY,
        )
        assert message.type == "message" and message.role == "assistant"
        assert text_of(message) == chat.choices[0].message.content
        cut = chat.choices[0].finish_reason == "length"
        assert message.stop_reason == ("max_tokens" if cut else "end_turn")
        assert chat.usage is not None
        usage = message.usage
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
        assert usage.output_tokens == chat.usage.completion_tokens
        counted = claude.messages.count_tokens(
            model=served.model, system="Be terse.", messages=CONVERSATION
        )
        assert counted.input_tokens == chat.usage.prompt_tokens


def test_a_stream_gives_the_whole_message_in_anthropic_events(served: Deployment) -> None:
    claude, _ = clients(served)
    ask: dict[str, Any] = {"model": served.model, "messages": CONVERSATION, "max_tokens": 12}
    ask["extra_body"] = GREEDY
    whole = claude.messages.create(**ask)
    events = list(claude.messages.create(stream=True, **ask))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == text_of(whole)
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with claude.messages.stream(**ask) as stream:  # the SDK's helper, built from the events
        helped = stream.get_final_message()
    assert text_of(helped) == text_of(whole) and helped.stop_reason == whole.stop_reason
    assert helped.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(served: Deployment) -> None:
    claude, _ = clients(served)
    ask: dict[str, Any] = {"model": served.model, "messages": CONVERSATION, "max_tokens": 16}
    ask["extra_body"] = GREEDY
    free = text_of(claude.messages.create(**ask))
    stop = free[len(free) // 2 :][:2]
    assert stop.strip(), free
    message = claude.messages.create(stop_sequences=[stop], **ask)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text_of(message) == free[: free.index(stop)]


def test_max_tokens_past_the_context_is_cut_to_it(served: Deployment) -> None:
    """Anthropic's clients ask for more output than a small model's context holds: the answer
    runs to the context's end (model_context_window_exceeded) instead of a 400, as chat's."""
    claude, chat_client = clients(served)
    with claude.messages.stream(  # (the SDK streams such a long ask)
        model=served.model, messages=CONVERSATION, max_tokens=100_000, extra_body=GREEDY
    ) as stream:
        message = stream.get_final_message()
    context = chat_client.models.retrieve(served.model).model_extra["max_model_len"]  # type: ignore[index]
    usage = message.usage
    used = usage.input_tokens + (usage.cache_read_input_tokens or 0) + usage.output_tokens
    if message.stop_reason == "model_context_window_exceeded":
        assert used == context
    else:  # the model ended its turn first
        assert message.stop_reason == "end_turn" and used < context
    with pytest.raises(openai.BadRequestError):  # chat's own limit stays a 400
        chat_client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=100_000)


def test_a_last_assistant_turn_is_the_start_of_the_answer(served: Deployment) -> None:
    """Anthropic's prefill: the answer goes on from the assistant's text (chat's
    continue_final_message)."""
    claude, chat_client = clients(served)
    started = [*CONVERSATION, {"role": "assistant", "content": "The capital is"}]
    message = claude.messages.create(
        model=served.model, messages=started, max_tokens=6, extra_body=GREEDY
    )
    chat = chat_client.chat.completions.create(
        model=served.model,
        messages=[*CHAT[1:], {"role": "assistant", "content": "The capital is"}],
        max_tokens=6,
        temperature=0,
        extra_body={"continue_final_message": True},
    )
    assert text_of(message) == chat.choices[0].message.content


def test_a_forced_tool_use_and_its_result(long_served: Deployment) -> None:
    """tool_choice tool: a tool_use block whose input fits the schema, whole and streamed (its
    input in input_json_delta events); its tool_result goes back in the next user turn."""
    claude, chat_client = clients(long_served)
    ask: dict[str, Any] = {"model": long_served.model, "tools": [ADD], "max_tokens": 80}
    ask |= {"tool_choice": {"type": "tool", "name": "add", "disable_parallel_tool_use": True}}
    ask |= {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "extra_body": GREEDY}
    message = claude.messages.create(**ask)
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "add" and uses[0].id
    jsonschema.validate(uses[0].input, ADD["input_schema"])
    events = list(claude.messages.create(stream=True, **ask))
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(partial) == uses[0].input
    with claude.messages.stream(**ask) as stream:
        helped = stream.get_final_message()
    assert [b.input for b in helped.content if b.type == "tool_use"] == [uses[0].input]
    follow_up: list[Any] = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "5"}],
        },
    ]
    answer = claude.messages.create(
        model=long_served.model, messages=follow_up, tools=[ADD], max_tokens=8, extra_body=GREEDY
    )
    chat = chat_client.chat.completions.create(
        model=long_served.model,
        messages=[
            {"role": "user", "content": "What is 2 + 3?"},
            {
                "role": "assistant",
                "content": text_of(message) or None,
                "tool_calls": [
                    {
                        "id": uses[0].id,
                        "type": "function",
                        "function": {"name": "add", "arguments": json.dumps(uses[0].input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": uses[0].id, "content": "5"},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "add",
                    "description": ADD["description"],
                    "parameters": ADD["input_schema"],
                },
            }
        ],
        max_tokens=8,
        temperature=0,
    )
    assert chat.usage is not None
    usage = answer.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    assert text_of(answer) == chat.choices[0].message.content


def test_an_output_format_gives_valid_json(served: Deployment) -> None:
    claude, _ = clients(served)
    schema = CITY_SCHEMA
    message = claude.messages.create(
        model=served.model,
        messages=[{"role": "user", "content": "Name a capital as JSON."}],
        max_tokens=60,
        extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(message)), schema)


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"max_tokens": None}, 400, "invalid_request_error"),
        ({"temperature": 1.5}, 400, "invalid_request_error"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
         "invalid_request_error"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "invalid_request_error"),
        ({"messages": []}, 400, "invalid_request_error"),
        ({"tool_choice": {"type": "tool"}}, 400, "invalid_request_error"),
        ({"tool_choice": {"type": "auto", "name": "add"}}, 400, "invalid_request_error"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t1", "name": "add", "input": {}}]}]}, 400,
         "invalid_request_error"),
        ({"messages": [*CONVERSATION, {"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "5"}]}]}, 400,
         "invalid_request_error"),
        ({"unknown_field": 1}, 400, "invalid_request_error"),
        ({"model": "nope"}, 404, "not_found_error"),
    ],
)  # fmt: skip
def test_what_a_message_cannot_do_is_an_error_in_anthropic_shape(
    served: Deployment, body: dict[str, Any], status: int, kind: str
) -> None:
    request = {"model": served.model, "max_tokens": 4, "messages": CONVERSATION} | body
    request = {k: v for k, v in request.items() if v is not None}
    r = httpx.post(f"{served.url}/v1/messages", json=request)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind, error
    assert error["error"]["message"]


def test_both_clients_list_the_models(served: Deployment) -> None:
    claude, chat_client = clients(served)
    listed = claude.models.list()
    assert [m.id for m in listed.data] == [served.model] and not listed.has_more
    model = claude.models.retrieve(served.model)
    assert (model.type, model.display_name) == ("model", served.model)
    assert [m.id for m in chat_client.models.list()] == [served.model]


def test_the_client_raises_typed_errors(served: Deployment) -> None:
    claude, _ = clients(served)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", messages=CONVERSATION, max_tokens=4)
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        claude.messages.create(
            model=served.model,
            messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}],
            max_tokens=4,
        )


def test_cache_hints_and_metadata_are_taken(served: Deployment) -> None:
    """cache_control marks and metadata change nothing: the answer is the plain request's."""
    claude, _ = clients(served)
    ask: dict[str, Any] = {"model": served.model, "max_tokens": 6, "extra_body": GREEDY}
    plain = claude.messages.create(system="Be terse.", messages=CONVERSATION, **ask)
    marked = [*CONVERSATION[:-1], {**CONVERSATION[-1], "content": [
        {"type": "text", "text": "And of Italy?", "cache_control": {"type": "ephemeral"}}
    ]}]  # fmt: skip
    hinted = claude.messages.create(
        system=[{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}],
        messages=marked,
        metadata={"user_id": "u1"},
        cache_control={"type": "ephemeral"},
        **ask,
    )
    assert text_of(hinted) == text_of(plain)
