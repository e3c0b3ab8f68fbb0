"""A Responses API response built from a choice's deltas (`frontend/responses_output.py`): whole
and streamed from one path, the message's logprobs its text's tokens', and reasoning items'
`encrypted_content`."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, cast

from kvbaton.frontend.postprocess import ChoiceState, Delta
from kvbaton.frontend.responses_api import ENCRYPTED_REASONING, LOGPROBS, ResponsesRequest
from kvbaton.frontend.responses_output import ResponseOutput, ResponseStream
from kvbaton.frontend.tool_calls import ToolCallDelta


@dataclass
class Finished:
    """What a response reads of its choice's state at the end."""

    finish_reason: str | None = "stop"
    prompt_tokens: int = 5
    completion_tokens: int = 6
    cached_tokens: int = 0


def lp(token: str) -> dict[str, Any]:
    return {"token": token, "logprob": -1.0, "bytes": list(token.encode()), "top_logprobs": []}


def build(deltas: list[tuple[Delta, list[dict[str, Any]]]], *include: str) -> Any:
    """(the whole response, the streamed events' bodies) of the same deltas."""
    request = ResponsesRequest.model_validate({"model": "m", "input": "x", "include": include})
    output = ResponseOutput("r1", request, "resp_1_2")
    whole, streamed = ResponseStream(output, emits=False), ResponseStream(output)
    state = cast(ChoiceState, Finished())
    events: list[bytes] = streamed.start(state)
    for delta, logprobs in deltas:
        whole.update(delta, logprobs)
        events += streamed.update(delta, logprobs)
    events += streamed.finish(state)
    bodies = [json.loads(e.split(b"data: ", 1)[1]) for e in events]
    return whole.whole(state), bodies


def test_the_message_logprobs_are_its_text_s_tokens_whole_and_streamed() -> None:
    """Reasoning tokens and a call's have none; a token whose text is held back gives its
    logprob with the text's delta; one whose text never comes, at the end."""
    deltas = [
        (Delta("", 1, reasoning="plan"), [lp("plan")]),
        (Delta("", 1), [lp("\xe2")]),  # held back: a character's first bytes
        (Delta("é!", 2), [lp("\xa9"), lp("!")]),
        (Delta("", 1, tool_calls=[ToolCallDelta(0, "{}", "c1", "f")]), [lp("<call>")]),
    ]
    whole, events = build(deltas, LOGPROBS)
    message = next(i for i in whole["output"] if i["type"] == "message")
    tokens = [e["token"] for e in message["content"][0]["logprobs"]]
    assert tokens == ["\xe2", "\xa9", "!"]
    streamed = [
        e["token"]
        for b in events
        if b["type"] == "response.output_text.delta"
        for e in b["logprobs"]
    ]
    assert streamed == tokens
    assert events[-1]["response"]["output"] == whole["output"]
    unfinished = [(Delta("ok", 1), [lp("ok")]), (Delta("", 1), [lp("\xe2")])]
    whole, events = build(unfinished, LOGPROBS)
    assert [e["token"] for e in whole["output"][0]["content"][0]["logprobs"]] == ["ok", "\xe2"]
    assert events[-1]["response"]["output"] == whole["output"]


def test_reasoning_carries_its_text_as_encrypted_content_when_asked() -> None:
    deltas = [(Delta("answer", 2, reasoning="plan"), [])]
    whole, events = build(deltas, ENCRYPTED_REASONING)
    reasoning = whole["output"][0]
    assert base64.b64decode(reasoning["encrypted_content"]).decode() == "plan"
    assert events[-1]["response"]["output"] == whole["output"]
    plain, _ = build(deltas)
    assert "encrypted_content" not in plain["output"][0]
    assert plain["output"][0]["content"] == reasoning["content"]


def test_a_response_of_reasoning_alone_has_no_empty_message() -> None:
    whole, events = build([(Delta("", 3, reasoning="plan"), [])])
    assert [i["type"] for i in whole["output"]] == ["reasoning"]
    assert events[-1]["response"]["output"] == whole["output"]
