"""The response of OpenAI's Responses API, from the chat answer of its request
(`responses_api.py`): whole (`ResponseOutput.whole`, from the chat completion) or as the API's
typed stream events (`ResponseStream`, from the choice's deltas).

- Output items, in order: the reasoning (with a reasoning parser, when there is some), the
  message (when it has text, or nothing else came), the function calls.
- `status` is "incomplete" (`incomplete_details.reason` "max_output_tokens") when the output
  reached its limit.
- A stream: `response.created`, `response.in_progress`, each item's events in output order (its
  `response.output_item.added`, its deltas, its `.done` events, `response.output_item.done`),
  then `response.completed` with the whole response (its `status` "incomplete" where it is:
  the event vLLM ends with, and the one the OpenAI SDK's stream helpers take as the end);
  every event numbered by `sequence_number`. An error mid-stream is an `error` event, the
  stream's last.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from kvbaton.frontend.errors import OpenAIError
from kvbaton.frontend.postprocess import ChoiceState, Delta
from kvbaton.frontend.responses_api import NamedFunction, ResponsesRequest

_encode = msgspec.json.Encoder().encode


class ResponseOutput:
    """One response's body, whole (`whole`) or at its stream's ends."""

    def __init__(self, rid: str, request: ResponsesRequest) -> None:
        self.request = request
        self.rid = rid
        self.id = f"resp_{rid}"
        self.created_at = int(time.time())

    def body(self, status: str, output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        """The response object: its request's settings, `output`, and `fields` over those."""
        r = self.request
        choice = r.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": r.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls,
            "temperature": r.temperature,
            "tool_choice": choice.model_dump()
            if isinstance(choice, NamedFunction)
            else choice or "auto",
            "tools": [t.model_dump() for t in r.tools or []],
            "top_p": r.top_p,
            "text": {"format": (r.text.format if r.text else None) or {"type": "text"}},
            "reasoning": r.reasoning.model_dump() if r.reasoning else None,
            "truncation": "disabled",
            "store": False,
            "usage": None,
        } | fields

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The response from the chat completion that answered it."""
        (choice,) = chat["choices"]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            output.append(self.reasoning_item(0, message["reasoning_content"]))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            output.append(self.message_item(len(output), message.get("content") or ""))
        for call in calls:
            function = call["function"]
            output.append(self.call_item(call["id"], function["name"], function["arguments"]))
        usage = chat["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        counts = (usage["prompt_tokens"], usage["completion_tokens"], cached)
        return self.finished(output, choice["finish_reason"], *counts)

    def finished(
        self,
        output: list[dict[str, Any]],
        finish_reason: str | None,
        input_tokens: int,
        output_tokens: int,
        cached_tokens: int,
    ) -> dict[str, Any]:
        incomplete = finish_reason == "length"
        return self.body(
            "incomplete" if incomplete else "completed",
            output,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage={
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": cached_tokens},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input_tokens + output_tokens,
            },
        )

    def reasoning_item(self, index: int, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {
            "type": "reasoning",
            "id": f"rs_{self.rid}_{index}",
            "summary": [],
            "content": content,
            "status": status,
        }

    def message_item(self, index: int, text: str, status: str = "completed") -> dict[str, Any]:
        content = [_text_part(text)] if status == "completed" else []
        return {
            "type": "message",
            "id": f"msg_{self.rid}_{index}",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    @staticmethod
    def call_item(
        call_id: str, name: str, arguments: str, status: str = "completed"
    ) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": f"fc_{call_id}",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Item:
    """An output item being streamed: its place, kind, id and text (or arguments) so far."""

    __slots__ = ("call_id", "id", "index", "kind", "name", "text")

    def __init__(self, index: int, kind: str, item_id: str, name: str = "", call_id: str = ""):
        self.index = index
        self.kind = kind  # "reasoning", "message" or "function_call"
        self.id = item_id
        self.name = name
        self.call_id = call_id
        self.text = ""


class ResponseStream:
    """A response's stream events (SSE), from its choice's deltas.

    - At most one item is open at a time: a new item closes the one before (the reasoning comes
      before the message, the message before the calls, each call before the next)."""

    def __init__(self, output: ResponseOutput) -> None:
        self.output = output
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # the closed ones, whole
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}  # by the parser's call index

    def start(self) -> list[bytes]:
        created = self.output.body("in_progress", [])
        return [
            self._event("response.created", response=created),
            self._event("response.in_progress", response=created),
        ]

    def update(self, delta: Delta) -> list[bytes]:
        events: list[bytes] = []
        if delta.reasoning:
            events += self._append("reasoning", delta.reasoning)
        if delta.text:
            events += self._append("message", delta.text)
        for call in delta.tool_calls:
            if call.id is not None:  # a new call: its name and id
                events += self._close()
                item = self._item("function_call", f"fc_{call.id}", call.name or "", call.id)
                self._calls[call.index] = item
                events += self._opened(item)
            if call.arguments:
                item = self._calls[call.index]
                item.text += call.arguments
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item.id,
                        output_index=item.index,
                        delta=call.arguments,
                    )
                )
        return events

    def finish(self, state: ChoiceState) -> list[bytes]:
        """The events that close the open item and end the response."""
        events = self._close()
        if not self._items:  # nothing came: an empty message
            events += self._append("message", "") + self._close()
        whole = self.output.finished(
            self._items,
            state.finish_reason,
            state.prompt_tokens,
            state.completion_tokens,
            state.cached_tokens,
        )
        return [*events, self._event("response.completed", response=whole)]

    def failed(self, error: OpenAIError) -> bytes:
        """The stream's last event, for a failure after it started: OpenAI's error event, with
        the body an OpenAI client raises on."""
        body = error.body()
        fault = body["error"]
        return self._event(
            "error",
            code=fault.get("code"),
            message=fault["message"],
            param=fault.get("param"),
            **body,
        )

    def _append(self, kind: str, text: str) -> list[bytes]:
        events: list[bytes] = []
        item = self._open
        if item is None or item.kind != kind:
            events += self._close()
            prefix = "rs" if kind == "reasoning" else "msg"
            item = self._item(kind, f"{prefix}_{self.output.rid}_{len(self._items)}")
            events += self._opened(item)
        item.text += text
        place: dict[str, Any] = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **place, delta=text))
        else:
            delta = {"delta": text, "logprobs": []}
            events.append(self._event("response.output_text.delta", **place, **delta))
        return events

    def _item(self, kind: str, item_id: str, name: str = "", call_id: str = "") -> _Item:
        item = _Item(len(self._items), kind, item_id, name, call_id)
        self._open = item
        return item

    def _opened(self, item: _Item) -> list[bytes]:
        events = [
            self._event(
                "response.output_item.added",
                output_index=item.index,
                item=self._whole(item, "in_progress"),
            )
        ]
        if item.kind == "message":
            place = {"item_id": item.id, "output_index": item.index, "content_index": 0}
            events.append(self._event("response.content_part.added", **place, part=_text_part("")))
        return events

    def _close(self) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        place: dict[str, Any] = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            events = [
                self._event("response.function_call_arguments.done", **place, arguments=item.text)
            ]
        elif item.kind == "reasoning":
            place["content_index"] = 0
            events = [self._event("response.reasoning_text.done", **place, text=item.text)]
        else:
            place["content_index"] = 0
            events = [
                self._event("response.output_text.done", **place, text=item.text, logprobs=[]),
                self._event("response.content_part.done", **place, part=_text_part(item.text)),
            ]
        whole = self._whole(item, "completed")
        self._items.append(whole)
        events.append(self._event("response.output_item.done", output_index=item.index, item=whole))
        return events

    def _whole(self, item: _Item, status: str) -> dict[str, Any]:
        out = self.output
        if item.kind == "function_call":
            text = item.text if status == "completed" else ""
            return out.call_item(item.call_id, item.name, text, status)
        if item.kind == "reasoning":
            return out.reasoning_item(item.index, item.text, status)
        return out.message_item(item.index, item.text, status)

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n"
