"""A migrated request's constraint on a vLLM worker, as a logits processor in vLLM's engine core.

- vLLM's structured outputs start their grammar at the first token vLLM generates. A constraint
  resumed past tokens another worker generated (`Guided.replay`, the prompt's tail) is applied
  here instead.
- Loaded by name (`RESUMED_CONSTRAINTS`) where vLLM schedules synchronously
  (`vllm_engine.resumes_constraints`): any logits processor makes vLLM's async scheduling wait
  for each step's tokens. A CPU never schedules async.
- Requests without `extra_args[REPLAYED_CONSTRAINT]` (`vllm_params.py`) are not tracked: they
  pay nothing per step.
- The grammar and matcher are kvbaton's engine's (`guided.py`, llguidance), which vLLM's
  structured outputs also use here (`vllm_options.py`): a prefix generated under one is taken by
  the other. The worker checks the replayed tokens before vLLM sees the request
  (`VllmEngine.add_request`), so a prefix that breaks the constraint is a request's error.
- A matcher that fails anyway (nothing should make it) allows only EOS: the request stops, and
  the engine core, which an exception here would end, goes on.
- vLLM's engine core imports this module by name (vLLM is imported at import).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import llguidance
import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from kvbaton.engine.guided import GuidedDecoding
from kvbaton.engine.vllm_params import REPLAYED_CONSTRAINT
from kvbaton.llm.model_files import eos_token_ids
from kvbaton.protocols.llm import Guided

log = logging.getLogger(__name__)


def guided_decoding(model_config: Any) -> GuidedDecoding:
    """kvbaton's guided decoding over vLLM's model (`ModelConfig`); ValueError without a
    `tokenizer.json` (llguidance reads it)."""
    directory = Path(model_config.tokenizer)
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(f"cannot resume a constraint: {directory} has no tokenizer.json")
    eos = eos_token_ids(getattr(model_config.hf_config, "eos_token_id", None))
    return GuidedDecoding(directory, model_config.get_vocab_size(), eos)


class ResumedConstraints(AdapterLogitsProcessor):  # type: ignore[misc]  # vLLM's, untyped here
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self._model_config = vllm_config.model_config
        self._guided: GuidedDecoding | None = None  # at the first replayed constraint

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> _Resumed | None:
        fields = (params.extra_args or {}).get(REPLAYED_CONSTRAINT)
        if fields is None:
            return None
        if self._guided is None:
            self._guided = guided_decoding(self._model_config)
        return _Resumed(self._guided, Guided(**fields))


class _Resumed:
    """One request's matcher: past the prompt's replayed tail, then each output token."""

    def __init__(self, guided: GuidedDecoding, constraint: Guided) -> None:
        self._guided = guided
        self._constraint = constraint
        self._matcher: llguidance.LLMatcher | None = None
        self._consumed = 0  # output tokens the matcher has taken

    def __call__(
        self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor
    ) -> torch.Tensor:
        if self._matcher is None:
            replayed = prompt_ids[len(prompt_ids) - self._constraint.replay :]
            self._matcher = self._guided.matcher(self._constraint, [])
            self._take(replayed)
        if len(output_ids) < self._consumed:  # vLLM dropped tokens (a failed KV load)
            self._matcher.rollback(self._consumed - len(output_ids))
            self._consumed = len(output_ids)
        self._take(output_ids[self._consumed :])
        self._consumed = len(output_ids)
        self._guided.mask(logits.unsqueeze(0), [(0, self._matcher)])
        return logits

    def _take(self, tokens: list[int]) -> None:
        assert self._matcher is not None
        if tokens and not self._matcher.consume_tokens(tokens):
            log.error("a resumed constraint broke: %s", self._matcher.get_error())
