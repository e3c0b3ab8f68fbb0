"""The response of OpenAI's Responses API, from the deltas of its request's chat answer
(`responses_api.py`): `ResponseStream` builds its items as they come, and gives them as the
API's typed stream events, or whole at the end (`ResponseStream.whole`): one path, so a
stream's final response is the whole one.

- Output items, in order: the reasoning (with a reasoning parser, when there is some), the
  message (when it has text, or nothing else came), the function calls.
- The message's logprobs (with include "message.output_text.logprobs") are its text's tokens':
  those of deltas with text, and of deltas with no text at all before them (text held back:
  a stop string's start, a character's first bytes; at the end, on a last delta of no text).
  Tokens of reasoning or of calls alone have none: the API has no place for them.
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

import base64
import time
from typing import Any

import msgspec

from kvbaton.frontend.errors import OpenAIError
from kvbaton.frontend.postprocess import ChoiceState, Delta
from kvbaton.frontend.responses_api import NamedFunction, ResponsesRequest

_encode = msgspec.json.Encoder().encode


class ResponseOutput:
    """One response's body: its request's settings around the items `ResponseStream` builds.

    - Its reasoning and message items' ids are its own id's, numbered (unique as it is: not
      the HTTP request's id, which a client may give twice); a call's is its call id's."""

    def __init__(self, rid: str, request: ResponsesRequest, response_id: str) -> None:
        """`rid`: the HTTP request's id (for the log); `response_id`: the response's."""
        self.request = request
        self.rid = rid
        self.id = response_id
        self.stem = response_id.removeprefix("resp_")  # of its items' ids
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
            "top_logprobs": r.top_logprobs,
            "truncation": "disabled",
            "store": r.store,
            "previous_response_id": r.previous_response_id,
            "metadata": r.metadata or {},
            "usage": None,
        } | fields

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
        done = status == "completed"
        item = {
            "type": "reasoning",
            "id": f"rs_{self.stem}_{index}",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if done else [],
            "status": status,
        }
        if done and self.request.encrypted_reasoning:
            item["encrypted_content"] = base64.b64encode(text.encode()).decode()
        return item

    def message_item(
        self,
        index: int,
        text: str,
        status: str = "completed",
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        content = [_text_part(text, logprobs)] if status == "completed" else []
        return {
            "type": "message",
            "id": f"msg_{self.stem}_{index}",
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


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


class _Item:
    """An output item being streamed: its place, kind, id and text (or arguments) so far."""

    __slots__ = ("call_id", "id", "index", "kind", "logprobs", "name", "text")

    def __init__(self, index: int, kind: str, item_id: str, name: str = "", call_id: str = ""):
        self.index = index
        self.kind = kind  # "reasoning", "message" or "function_call"
        self.id = item_id
        self.name = name
        self.call_id = call_id
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []  # a message's, in chat's shape


class ResponseStream:
    """A response's items, from its choice's deltas, with its stream events (SSE).

    - At most one item is open at a time: a new item closes the one before (the reasoning comes
      before the message, the message before the calls, each call before the next).
    - `emits` False: no event is encoded (each call gives b""), for a response given whole."""

    def __init__(self, output: ResponseOutput, emits: bool = True) -> None:
        self.output = output
        self.rid = output.rid
        self.model = output.request.model
        self.emits = emits
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # the closed ones, whole
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}  # by the parser's call index
        self._held: list[dict[str, Any]] = []  # logprobs of tokens whose text has not come

    def start(self, state: ChoiceState) -> list[bytes]:
        """The stream's first events (`state`: the choice's; its settings are the request's)."""
        created = self.output.body("in_progress", [])
        return [
            self._event("response.created", response=created),
            self._event("response.in_progress", response=created),
        ]

    def update(self, delta: Delta, logprobs: list[dict[str, Any]]) -> list[bytes]:
        """`logprobs`: the delta's tokens', in chat's shape (empty unless asked for)."""
        events: list[bytes] = []
        if delta.reasoning:
            events += self._append("reasoning", delta.reasoning)
        if delta.text:
            logprobs, self._held = self._held + logprobs, []
            events += self._append("message", delta.text, logprobs)
        elif delta.reasoning or delta.tool_calls:
            self._held = []
        else:
            self._held += logprobs
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
        events = self._end()
        return [*events, self._event("response.completed", response=self.response(state))]

    def whole(self, state: ChoiceState) -> dict[str, Any]:
        """The response, once the last delta is in (`state` its choice's)."""
        self._end()
        return self.response(state)

    def _end(self) -> list[bytes]:
        events: list[bytes] = []
        if self._held and (self._open.kind == "message" if self._open else not self._items):
            events += self._append("message", "", self._held)  # text never completed
        self._held = []
        events += self._close()
        if not self._items:  # nothing came: an empty message
            events += self._append("message", "") + self._close()
        return events

    def response(self, state: ChoiceState) -> dict[str, Any]:
        """The response as it stands (whole once `finish` or `whole` closed its items)."""
        return self.output.finished(
            self._items,
            state.finish_reason,
            state.prompt_tokens,
            state.completion_tokens,
            state.cached_tokens,
        )

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

    def _append(
        self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None
    ) -> list[bytes]:
        events: list[bytes] = []
        item = self._open
        if item is None or item.kind != kind:
            events += self._close()
            prefix = "rs" if kind == "reasoning" else "msg"
            item = self._item(kind, f"{prefix}_{self.output.stem}_{len(self._items)}")
            events += self._opened(item)
        item.text += text
        place: dict[str, Any] = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **place, delta=text))
        else:
            item.logprobs += logprobs or []
            delta = {"delta": text, "logprobs": logprobs or []}
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
            text, logprobs = item.text, item.logprobs
            events = [
                self._event("response.output_text.done", **place, text=text, logprobs=logprobs),
                self._event("response.content_part.done", **place, part=_text_part(text, logprobs)),
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
        return out.message_item(item.index, item.text, status, item.logprobs)

    def _event(self, kind: str, **fields: Any) -> bytes:
        if not self.emits:
            return b""
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n"
