"""Step S9 for one choice: engine outputs to text deltas (incremental detokenization, stop
strings held back across tokens, the reasoning split from the content, tool calls parsed out
of the content, logprobs) and the finish reason.

Invariants:
- The text sent for a choice (its reasoning and content joined, with the reasoning tags, and
  its tool calls as the model wrote them) is the detokenized output up to (not including) the
  first stop string: stop strings apply to the whole text, as in vLLM.
- `finish_reason` is set once, on the last delta."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvbaton.frontend.reasoning import ReasoningFormat, ReasoningSplitter
from kvbaton.frontend.tool_calls import ToolCall, ToolCallDelta
from kvbaton.frontend.tools import ToolUse
from kvbaton.llm.detokenizer import IncrementalDetokenizer
from kvbaton.llm.stop_strings import StopStringMatcher
from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.protocols.llm import EngineOutput, TokenLogprob


@dataclass
class Delta:
    text: str  # the content (all of the text without a reasoning parser)
    tokens: int  # new tokens in this delta (the text may lag behind them)
    finish_reason: str | None = None
    # One entry per new token: (token id, logprob, top alternatives as (id, logprob)).
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    reasoning: str = ""  # the reasoning's new text (with a reasoning parser only)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    # The first delta's, with the prompt's logprobs: the engine's (from the second token on).
    prompt_logprobs: list[list[TokenLogprob]] | None = None


class ChoiceState:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stops: list[str],
        reasoning: ReasoningFormat | None = None,
        continued: str | None = None,
        tools: ToolUse | None = None,
        echo: str = "",
        prompt_only: bool = False,
    ) -> None:
        """`reasoning`: split the reasoning from the content in that format (None: no split).
        `continued`: the text of the message the answer continues (None: it starts one).
        `tools`: parse tool calls out of the content (None: the content is all text).
        `echo`: text the first delta starts with (a completion's echoed prompt), apart from
        the answer's text: stop strings do not see it. `prompt_only`: the answer's tokens are
        dropped (not shown nor counted), its finish reason kept."""
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.prompt_tokens = len(prompt_token_ids)
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = StopStringMatcher(stops)
        self._reasoning = ReasoningSplitter(reasoning, continued) if reasoning is not None else None
        self._tools = tools
        self._echo = echo
        self._prompt_only = prompt_only
        self._calls = tools.parser() if tools is not None else None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.prompt_logprobs: list[list[TokenLogprob]] | None = None  # as the engine gave them
        self._text_offset = 0  # of the next token in `completion_logprobs`
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the answer (None: none did)."""
        return self._stops.matched

    def update(self, out: EngineOutput) -> Delta:
        """The delta for one engine output. After a stop string matched, the choice is finished
        (finish reason "stop") and the caller should stop the request at the worker.

        - With stop strings, an output of several tokens counts (and gives the logprobs of) the
          tokens up to the one that completed the match, as if they had come one by one."""
        if self._prompt_only:
            out = msgspec.structs.replace(out, token_ids=[], logprobs=None)
        if len(out.token_ids) > 1 and self._stops.stops:
            delta = self._update_each(out)
        else:
            delta = self._update(out)
        if self._echo:
            delta.text, self._echo = self._echo + delta.text, ""
        if out.prompt_logprobs is not None:
            delta.prompt_logprobs = self.prompt_logprobs = out.prompt_logprobs
        return delta

    def _update_each(self, out: EngineOutput) -> Delta:
        deltas: list[Delta] = []
        last = len(out.token_ids) - 1
        for i, token in enumerate(out.token_ids):
            part = EngineOutput(
                request_id=out.request_id,
                token_ids=[token],
                finish_reason=out.finish_reason if i == last else None,
                usage=out.usage,
                logprobs=out.logprobs[i : i + 1] if out.logprobs is not None else None,
            )
            deltas.append(self._update(part))
            if self.finished:
                break
        return Delta(
            "".join(d.text for d in deltas),
            sum(d.tokens for d in deltas),
            deltas[-1].finish_reason,
            [lp for d in deltas for lp in d.logprobs],
            "".join(d.reasoning for d in deltas),
            [call for d in deltas for call in d.tool_calls],
        )

    def _update(self, out: EngineOutput) -> Delta:
        self.completion_tokens += len(out.token_ids)
        if out.usage is not None:
            self.cached_tokens = out.usage.cached_tokens
        text = self._stops.feed(self._detok.add(out.token_ids))
        if self._stops.matched is not None:
            self.finish_reason = "stop"
        elif out.finish_reason is not None:
            if out.finish_reason == "abort":
                raise RuntimeError("the worker aborted the request")
            text += self._stops.flush()
            self.finish_reason = out.finish_reason
        delta = Delta(text, len(out.token_ids), self.finish_reason, _logprobs(out.logprobs))
        if self._reasoning is not None:
            delta.reasoning, delta.text = self._reasoning.feed(text, final=self.finished)
        if self._calls is not None and self._tools is not None:
            split = self._calls.feed(delta.text, final=self.finished)
            delta.text, delta.tool_calls = split.content, split.calls
            if self.finish_reason is not None:
                self.finish_reason = self._tools.finish_reason(
                    self.finish_reason, bool(self.tool_calls)
                )
                delta.finish_reason = self.finish_reason
        return delta

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls parsed so far (those kept: one without `parallel_tool_calls`)."""
        return self._calls.kept_calls if self._calls is not None else []

    # -- logprobs in OpenAI's two shapes ---------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.backend.decode([token_id], skip_special_tokens=False))

    def chat_logprobs(self, delta: Delta) -> dict[str, Any] | None:
        if not delta.logprobs:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                entry(t, lp) | {"top_logprobs": [entry(a, alp) for a, alp in top]}
                for t, lp, top in delta.logprobs
            ]
        }

    def completion_logprobs(self, delta: Delta, echo_top: int | None) -> dict[str, Any] | None:
        """OpenAI's completion shape: an echoed prompt's tokens first (with `echo_top` set:
        that many alternatives; the first token with null logprob and alternatives), then the
        answer's.

        - `text_offset`: where each token's text starts in the choice's, counted over the
          tokens' texts as vLLM counts (from 0, across the deltas of the choice)."""
        entries: list[tuple[int, float | None, list[tuple[int, float]] | None]]
        entries = list(delta.logprobs)
        if delta.prompt_logprobs is not None and echo_top is not None:
            first = (self.prompt_token_ids[0], None, None)
            shown = [e[: 1 + echo_top] for e in delta.prompt_logprobs]
            entries = [first, *_logprobs(shown), *entries]
        if not entries:
            return None
        tokens = [self.token_text(t) for t, _, _ in entries]
        offsets = list(itertools.accumulate((len(t) for t in tokens), initial=self._text_offset))
        self._text_offset = offsets.pop()
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [
                None if top is None else {self.token_text(a): alp for a, alp in top}
                for _, _, top in entries
            ],
            "text_offset": offsets,
        }

    def vllm_prompt_logprobs(self, top: int) -> list[dict[str, dict[str, Any]] | None]:
        """The prompt's logprobs as vLLM's `prompt_logprobs` field: null for the first token,
        then per token its own and the `top` best by token id, each with its rank and text."""
        shown: list[dict[str, dict[str, Any]] | None] = [None]
        for chosen, *best in self.prompt_logprobs or []:
            position: dict[str, dict[str, Any]] = {}
            for lp, rank in [(chosen, chosen.rank), *zip(best[:top], itertools.count(1))]:
                position.setdefault(  # the chosen one first: once, if it is among the best
                    str(lp.token_id),
                    {
                        "logprob": lp.logprob,
                        "rank": rank,
                        "decoded_token": self.token_text(lp.token_id),
                    },
                )
            shown.append(position)
        return shown


def _logprobs(
    entries: list[list[TokenLogprob]] | None,
) -> list[tuple[int, float, list[tuple[int, float]]]]:
    if not entries:
        return []
    return [
        (e[0].token_id, e[0].logprob, [(a.token_id, a.logprob) for a in e[1:]]) for e in entries
    ]
