"""The offline face, like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from kvbaton.engine.config import EngineConfig
from kvbaton.engine.connector import EngineRequest
from kvbaton.engine.engine import LLMEngine
from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.protocols.llm import SamplingParams, TokenLogprob


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[list[TokenLogprob]] | None = None
    prompt_logprobs: list[list[TokenLogprob]] | None = None  # from the prompt's second token


class LLM:
    def __init__(self, model: str = "smollm2", **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self.tokenizer = Tokenizer(self.engine.model_dir)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Seq[str] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of the prompts (text, or token id lists)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(token_lists, params)

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One output per conversation (a list of {"role", "content"} messages)."""
        convs = (
            [conversations]
            if conversations and isinstance(conversations[0], dict)
            else conversations
        )
        return self._run(
            [self.tokenizer.apply_chat_template(c) for c in convs],  # type: ignore[arg-type]
            params,
        )

    def _run(
        self, token_lists: list[list[int]], params: SamplingParams | Seq[SamplingParams] | None
    ) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(token_lists)
        if len(params) != len(token_lists):
            raise ValueError("give one SamplingParams, or one per prompt")
        outputs: dict[str, RequestOutput] = {}
        for tokens, p in zip(token_lists, params, strict=True):
            self.engine.check_request(tokens, p)
        for tokens, p in zip(token_lists, params, strict=True):
            rid = f"offline-{next(self._ids)}"
            outputs[rid] = RequestOutput(rid, tokens)
            self.engine.add_request(EngineRequest(rid, tokens, p))
        while self.engine.has_unfinished():
            for out in self.engine.step():
                result = outputs[out.request_id]
                result.token_ids += out.token_ids
                if out.logprobs is not None:
                    result.logprobs = (result.logprobs or []) + out.logprobs
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                if out.finish_reason is not None:
                    result.finish_reason = out.finish_reason
                    result.num_cached_tokens = out.usage.cached_tokens if out.usage else 0
        for result in outputs.values():
            result.text = self.tokenizer.decode(result.token_ids)
        return list(outputs.values())
