"""OpenAI's response bodies for one request: chat or text completion, whole or as SSE chunks."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from kvbaton.frontend.postprocess import ChoiceState, Delta
from kvbaton.frontend.tool_calls import ToolCall, ToolCallDelta

_encode = msgspec.json.Encoder().encode


class ResponseShape:
    """OpenAI's response bodies for one request: chat or text completion, whole or chunked.

    - `reasoning` (chat only): a whole answer's message has `reasoning_content` (null when
      there was none); a chunk's delta has it when the chunk carries reasoning.
    - Tool calls (chat only): a whole answer's message has `tool_calls` when the model called
      (and `content` null if it wrote nothing else); a chunk's delta announces a call (index,
      id, type, name, empty arguments) before its argument fragments.
    - `n` choices in all, `per_prompt` of each prompt (choice i is prompt i // per_prompt's).
    - A prompt's logprobs: a completion's echoed prompt's tokens lead its choice's `logprobs`
      with `echo_top` alternatives; vLLM's `prompt_logprobs` field, with `prompt_top`, is on
      each whole completion choice and on a whole chat response (never in chunks).
    """

    def __init__(
        self,
        rid: str,
        model: str,
        chat: bool,
        n: int,
        reasoning: bool = False,
        per_prompt: int = 1,
        echo_top: int | None = None,
        prompt_top: int | None = None,
    ) -> None:
        self.rid = rid
        self.model = model
        self.chat = chat
        self.n = n
        self.per_prompt = per_prompt
        self.reasoning = reasoning and chat
        self.echo_top = echo_top
        self.prompt_top = prompt_top
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
        self.created = int(time.time())
        self._event_start = b"data: " + _encode(self._head(True))[:-1] + b',"choices":['

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": f"{kind}.chunk" if chunk and self.chat else kind,
            "created": self.created,
            "model": self.model,
        }

    @staticmethod
    def sse(body: dict[str, Any]) -> bytes:
        return b"data: " + _encode(body) + b"\n\n"

    def logprobs(self, state: ChoiceState, delta: Delta) -> Any:
        if self.chat:
            return state.chat_logprobs(delta)
        return state.completion_logprobs(delta, self.echo_top)

    def role_chunk(self, index: int, include_usage: bool) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._head(True) | {"choices": [choice]} | _null_usage(include_usage)

    def chunk_event(
        self, state: ChoiceState, index: int, delta: Delta, include_usage: bool
    ) -> bytes:
        """The SSE event of one delta: equal to `sse` of its chunk, the chunk's head (id, object,
        created, model) encoded once per request."""
        end = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
        return self._event_start + _encode(self._choice(state, index, delta)) + end

    def _choice(self, state: ChoiceState, index: int, delta: Delta) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {}
            if delta.reasoning:
                choice["delta"]["reasoning_content"] = delta.reasoning
            if delta.text:
                choice["delta"]["content"] = delta.text
            if delta.tool_calls:
                choice["delta"]["tool_calls"] = [_call_delta(c) for c in delta.tool_calls]
        else:
            choice["text"] = delta.text
        choice["logprobs"] = self.logprobs(state, delta)
        choice["finish_reason"] = delta.finish_reason
        return choice

    def usage_chunk(self, states: dict[int, ChoiceState]) -> dict[str, Any]:
        return self._head(True) | {"choices": [], "usage": _usage(states, self.per_prompt)}

    def full(
        self,
        states: dict[int, ChoiceState],
        texts: list[str],
        reasonings: list[str],
        logprobs: list[list[Any]],
    ) -> dict[str, Any]:
        choices = []
        for i in range(self.n):
            choice: dict[str, Any] = {"index": i}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": texts[i]}
                calls = states[i].tool_calls if i in states else []
                if calls:
                    choice["message"]["content"] = texts[i] or None
                    choice["message"]["tool_calls"] = [_call(c) for c in calls]
                if self.reasoning:
                    choice["message"]["reasoning_content"] = reasonings[i] or None
                lps = [e for part in logprobs[i] for e in part["content"]]
                choice["logprobs"] = {"content": lps} if logprobs[i] else None
            else:
                choice["text"] = texts[i]
                choice["logprobs"] = _join_completion_logprobs(logprobs[i])
                if self.prompt_top is not None and i in states:
                    choice["prompt_logprobs"] = states[i].vllm_prompt_logprobs(self.prompt_top)
            choice["finish_reason"] = states[i].finish_reason if i in states else None
            choices.append(choice)
        body = self._head(False) | {"choices": choices, "usage": _usage(states, self.per_prompt)}
        if self.chat and self.prompt_top is not None and 0 in states:  # one prompt: choice 0's
            body["prompt_logprobs"] = states[0].vllm_prompt_logprobs(self.prompt_top)
        return body


def _call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {
        "index": delta.index,
        "id": delta.id,
        "type": "function",
        "function": {"name": delta.name, "arguments": delta.arguments},
    }


def _null_usage(include_usage: bool) -> dict[str, Any]:
    return {"usage": None} if include_usage else {}


def _usage(states: dict[int, ChoiceState], per_prompt: int = 1) -> dict[str, Any]:
    """As OpenAI counts it: each prompt's tokens once, however many choices it has (its cached
    ones as its first choice, the one that prefilled it, found them), and every choice's
    completion tokens."""
    firsts = [s for i, s in states.items() if i % per_prompt == 0]
    prompt = sum(s.prompt_tokens for s in firsts)
    completion = sum(s.completion_tokens for s in states.values())
    cached = sum(s.cached_tokens for s in firsts)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _join_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not parts:
        return None
    return {key: [v for part in parts for v in part[key]] for key in parts[0]}
