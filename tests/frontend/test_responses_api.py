"""OpenAI's Responses API (`/v1/responses`) of a real `kvbaton serve`, through the official
`openai` client: each response is the chat answer of the same conversation (input items as
messages, function tools, the text format), whole and streamed as typed events; what it
cannot do (keep responses, other tools, images) is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvbaton.frontend.responses_api import LOGPROBS
from tests.frontend.conftest import Deployment
from tests.helpers import ADD_PARAMETERS, CITY_SCHEMA

pytestmark = pytest.mark.integration

ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": ADD_PARAMETERS,
}


@pytest.fixture(scope="module")
def client(served: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)


def events_of(client: openai.OpenAI, **ask: Any) -> list[Any]:
    return list(client.responses.create(stream=True, **ask))


def test_a_response_is_the_chat_answer_of_its_conversation(
    client: openai.OpenAI, served: Deployment
) -> None:
    """Instructions and items (an earlier answer among them) give the chat answer of the same
    messages: its text, its usage, and `incomplete` where it reached max_output_tokens."""
    items: list[Any] = [
        {"role": "user", "content": "What is the capital of France?"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Paris.", "annotations": []}],
        },
        {"role": "user", "content": [{"type": "input_text", "text": "And of Italy?"}]},
    ]
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    for limit in (3, 40):
        ask: dict[str, Any] = {"model": served.model, "temperature": 0}
        chat = client.chat.completions.create(messages=messages, max_tokens=limit, **ask)
        response = client.responses.create(
            input=items, instructions="Be terse.", max_output_tokens=limit, **ask
        )
        assert response.object == "response" and response.id.startswith("resp_")
        assert response.output_text == chat.choices[0].message.content
        (message,) = response.output
        assert message.type == "message" and message.role == "assistant"
        cut = chat.choices[0].finish_reason == "length"
        assert response.status == ("incomplete" if cut else "completed")
        if cut:
            assert response.incomplete_details is not None
            assert response.incomplete_details.reason == "max_output_tokens"
        assert response.usage is not None and chat.usage is not None
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.usage.output_tokens == chat.usage.completion_tokens
        assert response.usage.total_tokens == chat.usage.total_tokens
    one = client.responses.create(model=served.model, input="Hi", max_output_tokens=4)
    assert one.usage is not None and one.usage.output_tokens <= 4


def test_a_stream_gives_the_whole_response_in_numbered_events(
    client: openai.OpenAI, served: Deployment
) -> None:
    ask: dict[str, Any] = {"model": served.model, "input": "Hello there", "temperature": 0}
    ask["max_output_tokens"] = 12
    whole = client.responses.create(**ask)
    events = events_of(client, **ask)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] == "response.completed"  # as vLLM ends, whatever the status
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage is not None and whole.usage is not None
    counts = [(u.input_tokens, u.output_tokens) for u in (final.usage, whole.usage)]
    assert counts[0] == counts[1]  # (their cached tokens differ: the second hits the first's)
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    with client.responses.stream(**ask) as stream:  # the SDK's helper, which builds from events
        helped = stream.get_final_response()
    assert helped.output_text == whole.output_text and helped.status == whole.status


def test_a_forced_function_call_and_its_answer(long_served: Deployment) -> None:
    """tool_choice required: a function_call item whose arguments fit the schema, whole and
    streamed (its arguments in deltas); the call and its output go back as items."""
    served = long_served
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
    ask: dict[str, Any] = {"model": served.model, "tools": [ADD], "tool_choice": "required"}
    ask |= {"input": "What is 2 + 3?", "temperature": 0, "max_output_tokens": 80}
    ask["parallel_tool_calls"] = False  # one call, then the end
    response = client.responses.create(**ask)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and response.status == "completed"
    call = calls[0]
    assert call.name == "add" and call.call_id
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    events = events_of(client, **ask)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == [i.type for i in response.output]
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and "".join(e.arguments for e in done) == arguments
    assert [e.arguments for e in done] == [c.arguments for c in calls]
    with client.responses.stream(**ask) as stream:
        helped = stream.get_final_response()
    assert [(i.type, getattr(i, "arguments", None)) for i in helped.output] == [
        (i.type, getattr(i, "arguments", None)) for i in response.output
    ]
    follow_up: list[Any] = [
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": "add",
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
    ]
    answer = client.responses.create(
        model=served.model, input=follow_up, tools=[ADD], max_output_tokens=8, temperature=0
    )
    chat = client.chat.completions.create(
        model=served.model,
        messages=[
            {"role": "user", "content": "What is 2 + 3?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "add", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "5"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}],
        max_tokens=8,
        temperature=0,
    )
    assert answer.usage is not None and chat.usage is not None
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


def test_a_json_schema_format_gives_valid_json(client: openai.OpenAI, served: Deployment) -> None:
    schema = CITY_SCHEMA
    response = client.responses.create(
        model=served.model,
        input="Name a capital as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input"),
        ({"input": [{"type": "computer_call"}]}, "input"),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"unknown_field": 1}, "unknown_field"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"top_logprobs": 21, "include": [LOGPROBS]}, "top_logprobs"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ],
)  # fmt: skip
def test_what_a_response_cannot_do_is_a_400_naming_it(
    served: Deployment, body: dict[str, Any], param: str
) -> None:
    request = {"model": served.model, "input": "x"} | body
    r = httpx.post(f"{served.url}/v1/responses", json=request)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error


def test_hints_and_identifiers_are_taken(client: openai.OpenAI, served: Deployment) -> None:
    ask: dict[str, Any] = {"model": served.model, "input": "Hi", "max_output_tokens": 4}
    ask["temperature"] = 0
    plain = client.responses.create(**ask)
    hinted = client.responses.create(
        **ask,
        store=True,
        metadata={"k": "v"},
        prompt_cache_key="session-1",
        prompt_cache_retention="24h",
        safety_identifier="user-hash",
        text={"verbosity": "medium"},
    )
    assert hinted.output_text == plain.output_text
    streamed = events_of(client, **ask, stream_options={"include_obfuscation": False})
    assert streamed[-1].response.output_text == plain.output_text


def test_the_message_logprobs_are_the_chat_answer_s(
    client: openai.OpenAI, served: Deployment
) -> None:
    """include message.output_text.logprobs: the message's tokens and logprobs, with
    `top_logprobs` alternatives each, equal to the chat answer's, whole and streamed."""
    ask: dict[str, Any] = {"model": served.model, "temperature": 0}
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=10,
        logprobs=True,
        top_logprobs=2,
        **ask,
    )
    assert chat.choices[0].logprobs is not None
    expected = chat.choices[0].logprobs.content
    assert expected
    ask |= {"input": "Hello there", "max_output_tokens": 10, "top_logprobs": 2}
    response = client.responses.create(**ask, include=[LOGPROBS])
    assert response.top_logprobs == 2
    (message,) = response.output
    assert message.type == "message"
    (part,) = message.content
    assert part.type == "output_text" and part.logprobs is not None
    assert_same_logprobs(part.logprobs, expected)
    assert all(len(e.top_logprobs) == 2 for e in part.logprobs)
    events = events_of(client, **ask, include=[LOGPROBS])
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert_same_logprobs([lp for e in deltas for lp in e.logprobs], expected)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert_same_logprobs(done.logprobs, expected)
    assert_same_logprobs(events[-1].response.output[0].content[0].logprobs, expected)
    plain = client.responses.create(**ask | {"top_logprobs": 0})
    assert plain.output[0].content[0].logprobs == []


def assert_same_logprobs(got: Any, expected: Any) -> None:
    """Equal tokens, logprobs equal within float32's rounding (a prefix cache hit computes the
    prompt's last tokens in another batch shape)."""
    assert [e.token for e in got] == [e.token for e in expected]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in expected], abs=1e-4)
