"""The message of Anthropic's Messages API, from the deltas of its request's chat answer
(`messages_api.py`): `MessageStream` builds its content blocks as they come, and gives them as
the API's stream events, or whole at the end (`MessageStream.whole`): one path, so a stream's
message is the whole one.

- Content blocks, in order: `thinking` (with a reasoning parser, when there is some; its
  `signature` empty: kvbaton signs nothing; its text left out with `display` "omitted"),
  `text`, then a `tool_use` block per call (`input` the call's arguments, parsed; arguments
  that are no JSON object are kept as `{"arguments": ...}`).
- `stop_reason`: "max_tokens" at the limit, "model_context_window_exceeded" at the context's
  end before it (the limit cut to the context: `messages_api.py`), "tool_use" after calls,
  "stop_sequence" (with `stop_sequence`, the one that matched), else "end_turn".
- `usage`: `input_tokens` are the prompt's tokens that the prefix cache did not hold, and
  `cache_read_input_tokens` those it held (Anthropic's split); `output_tokens` the answer's.
- A stream: `message_start`, each block's `content_block_start`, deltas (`text_delta`,
  `thinking_delta`, then a `signature_delta`; a call's input whole in one `input_json_delta`,
  as the whole message has it) and `content_block_stop`, then
  `message_delta` (the stop reason, the usage) and `message_stop`. An error after the start is
  an `error` event, the stream's last.
- Errors are in Anthropic's shape (`OpenAIError.anthropic_body`), for its clients to raise on.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from kvbaton.frontend.errors import OpenAIError
from kvbaton.frontend.messages_api import MessagesRequest
from kvbaton.frontend.postprocess import ChoiceState, Delta

_encode = msgspec.json.Encoder().encode


class _Block:
    """A content block being built: its place, kind and text (a call's arguments) so far."""

    __slots__ = ("id", "index", "kind", "name", "text")

    def __init__(self, index: int, kind: str, call_id: str = "", name: str = "") -> None:
        self.index = index
        self.kind = kind  # "thinking", "text" or "tool_use"
        self.id = call_id
        self.name = name
        self.text = ""

    def whole(self) -> dict[str, Any]:
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": self.text, "signature": ""}
        if self.kind == "text":
            return {"type": "text", "text": self.text}
        return {
            "type": "tool_use",
            "id": self.id,
            "name": self.name,
            "input": _arguments(self.text),
        }


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {"arguments": text}  # what the model wrote, kept (not an object)
    return value if isinstance(value, dict) else {"arguments": value}


class MessageStream:
    """A message's content blocks, from its choice's deltas, with its stream events (SSE).

    - At most one block is open at a time: a new block closes the one before.
    - `emits` False: no event is encoded (each call gives b""), for a message given whole."""

    def __init__(self, rid: str, request: MessagesRequest, emits: bool = True) -> None:
        """`rid`: the HTTP request's id (for the log)."""
        self.rid = rid
        self.model = request.model
        self.max_tokens = request.max_tokens
        thinking = request.thinking
        self.shows_thinking = thinking is None or thinking.display != "omitted"
        self.id = f"msg_{uuid.uuid4().hex}"
        self.emits = emits
        self._blocks: list[_Block] = []
        self._open: _Block | None = None
        self._calls: dict[int, _Block] = {}  # by the parser's call index

    def start(self, state: ChoiceState) -> list[bytes]:
        """The stream's first event (`state`: the choice's, at its first output)."""
        head = self._message([], None, None, self._usage(state) | {"output_tokens": 0})
        return [self._event("message_start", message=head)]

    def update(self, delta: Delta, logprobs: list[dict[str, Any]]) -> list[bytes]:
        """`logprobs`: not given by this API (taken for the same call as the Responses API's)."""
        events: list[bytes] = []
        if delta.reasoning:
            events += self._append("thinking", delta.reasoning)
        if delta.text:
            events += self._append("text", delta.text)
        for call in delta.tool_calls:
            if call.id is not None:  # a new call: its name and id
                events += self._close()
                block = self._opened("tool_use", call.id, call.name or "")
                self._calls[call.index] = block
                events += self._started(block)
            if call.arguments:  # given whole as the block closes
                self._calls[call.index].text += call.arguments
        return events

    def finish(self, state: ChoiceState) -> list[bytes]:
        """The events that close the open block and end the message."""
        events = self._end()
        stop_reason, stop_sequence = self._stop(state)
        usage = self._usage(state)
        events.append(
            self._event(
                "message_delta",
                delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                usage=usage,
            )
        )
        return [*events, self._event("message_stop")]

    def whole(self, state: ChoiceState) -> dict[str, Any]:
        """The message, once the last delta is in (`state` its choice's)."""
        self._end()
        return self.response(state)

    def response(self, state: ChoiceState) -> dict[str, Any]:
        """The message as it stands (whole once `finish` or `whole` closed its blocks)."""
        return self._message(
            [b.whole() for b in self._blocks], *self._stop(state), self._usage(state)
        )

    def failed(self, error: OpenAIError) -> bytes:
        """The stream's last event, for a failure after it started."""
        return self._event("error", error=error.anthropic_body()["error"])

    def _end(self) -> list[bytes]:
        events = self._close()
        if not self._blocks:  # nothing came: an empty text block
            events += self._append("text", "") + self._close()
        return events

    def _stop(self, state: ChoiceState) -> tuple[str, str | None]:
        if state.finish_reason == "length":
            cut = state.completion_tokens < self.max_tokens  # by the context, first
            return "model_context_window_exceeded" if cut else "max_tokens", None
        if any(b.kind == "tool_use" for b in self._blocks):
            return "tool_use", None
        if state.stop_string is not None:
            return "stop_sequence", state.stop_string
        return "end_turn", None

    @staticmethod
    def _usage(state: ChoiceState) -> dict[str, Any]:
        return {
            "input_tokens": state.prompt_tokens - state.cached_tokens,
            "cache_read_input_tokens": state.cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": state.completion_tokens,
        }

    def _message(
        self,
        content: list[dict[str, Any]],
        stop_reason: str | None,
        stop_sequence: str | None,
        usage: dict[str, Any],
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def _append(self, kind: str, text: str) -> list[bytes]:
        events: list[bytes] = []
        block = self._open
        if block is None or block.kind != kind:
            events += self._close()
            block = self._opened(kind)
            events += self._started(block)
        if kind == "thinking" and not self.shows_thinking:
            text = ""  # display "omitted"
        block.text += text
        if text:
            key = "thinking" if kind == "thinking" else "text"
            events.append(self._delta(block, {"type": f"{key}_delta", key: text}))
        return events

    def _opened(self, kind: str, call_id: str = "", name: str = "") -> _Block:
        block = _Block(len(self._blocks), kind, call_id, name)
        self._blocks.append(block)
        self._open = block
        return block

    def _started(self, block: _Block) -> list[bytes]:
        start = block.whole() if block.kind != "tool_use" else {
            "type": "tool_use", "id": block.id, "name": block.name, "input": {}
        }  # fmt: skip
        return [self._event("content_block_start", index=block.index, content_block=start)]

    def _close(self) -> list[bytes]:
        block, self._open = self._open, None
        if block is None:
            return []
        events = []
        if block.kind == "thinking":
            events.append(self._delta(block, {"type": "signature_delta", "signature": ""}))
        if block.kind == "tool_use":  # the input as the whole message has it, always an object
            partial = json.dumps(_arguments(block.text))
            events.append(self._delta(block, {"type": "input_json_delta", "partial_json": partial}))
        events.append(self._event("content_block_stop", index=block.index))
        return events

    def _delta(self, block: _Block, body: dict[str, Any]) -> bytes:
        return self._event("content_block_delta", index=block.index, delta=body)

    def _event(self, kind: str, **fields: Any) -> bytes:
        if not self.emits:
            return b""
        body = {"type": kind, **fields}
        return b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n"
