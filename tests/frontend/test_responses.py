"""The SSE events of a stream's deltas: whole chunks, the head encoded once per request."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from kvbaton.frontend.postprocess import ChoiceState, Delta
from kvbaton.frontend.responses import ResponseShape
from kvbaton.frontend.tool_calls import ToolCallDelta

pytestmark = pytest.mark.unit

STATE: Any = SimpleNamespace(
    chat_logprobs=lambda delta: {"content": [{"token": "a"}]} if delta.logprobs else None,
    completion_logprobs=lambda delta, echo_top: {"tokens": ["a"]} if delta.logprobs else None,
)


def parse(event: bytes) -> Any:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    return msgspec.json.decode(event[6:-2])


def head(id_: str, object_: str, model: str, shape: ResponseShape) -> dict[str, Any]:
    return {"id": id_, "object": object_, "created": shape.created, "model": model}


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_chat_delta_is_one_whole_chunk(include_usage: bool) -> None:
    shape = ResponseShape("r1", "m/x", True, 2, reasoning=True)
    call = ToolCallDelta(index=0, arguments="", id="call_0", name="f")
    delta = Delta(text="Hi", tokens=1, reasoning="so", tool_calls=[call], logprobs=[(5, -0.5, [])])
    state: ChoiceState = STATE
    chunk = parse(shape.chunk_event(state, 1, delta, include_usage))
    assert chunk == head("chatcmpl-r1", "chat.completion.chunk", "m/x", shape) | {
        "choices": [
            {
                "index": 1,
                "delta": {
                    "reasoning_content": "so",
                    "content": "Hi",
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_0",
                            "type": "function",
                            "function": {"name": "f", "arguments": ""},
                        }
                    ],
                },
                "logprobs": {"content": [{"token": "a"}]},
                "finish_reason": None,
            }
        ],
    } | ({"usage": None} if include_usage else {})


def test_a_completion_delta_is_one_whole_chunk_with_its_finish_reason() -> None:
    shape = ResponseShape("r2", "m", False, 1)
    delta = Delta(text='"quoted"\n', tokens=2, finish_reason="length")
    chunk = parse(shape.chunk_event(STATE, 0, delta, False))
    assert chunk == head("cmpl-r2", "text_completion", "m", shape) | {
        "choices": [
            {"index": 0, "text": '"quoted"\n', "logprobs": None, "finish_reason": "length"}
        ],
    }
