"""Guided decoding: a per-sequence token mask from a grammar (`llm/constraints.py`), computed
by llguidance.

- A constraint (`SamplingParams.guided`) compiles once per (kind, spec) into a template matcher,
  cached; `compile` is what callers run off the step loop (AsyncEngine does, on a thread).
- A sequence's matcher is a copy of the template that has consumed every output token the
  sequence has (those sampled elsewhere too: a prefill worker's, a migrated request's).
- Once the grammar is complete its mask allows only EOS: the request stops as usual.
- Rows with no constraint pay nothing.
- llguidance's torch helpers compile their mask kernel with torch.compile: importing them
  imports torch's compiler (seconds), and the kernel's first call compiles it (seconds more).
  Both happen at the first constraint's `compile`, off the step loop; an engine that never sees
  a constraint pays neither.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from types import ModuleType

import llguidance
import torch

from kvbaton.llm.constraints import grammar
from kvbaton.protocols.llm import Guided

CACHED_GRAMMARS = 256


class GuidedDecoding:
    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        """The tokenizer is read at the first constraint (a third of a second for 49k tokens:
        workers that never see one do not pay it)."""
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos = min(eos_token_ids) if eos_token_ids else None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._templates: dict[tuple[str, str], llguidance.LLMatcher] = {}  # oldest first
        self._lock = threading.Lock()  # compile runs on callers' threads

    def compile(self, guided: Guided) -> None:
        """Compile the constraint into the cache (a no-op once there), and the mask kernel at
        the first one; ValueError if invalid."""
        self._template(guided)
        _compiled_mask_ops(self.vocab_size)

    def matcher(self, guided: Guided, output_token_ids: list[int]) -> llguidance.LLMatcher:
        """A fresh matcher for a sequence, past `output_token_ids`; ValueError if they break
        the constraint."""
        matcher = self._template(guided).deep_copy()
        if output_token_ids and not matcher.consume_tokens(output_token_ids):
            raise ValueError(f"the output so far breaks the constraint: {matcher.get_error()}")
        return matcher

    def _template(self, guided: Guided) -> llguidance.LLMatcher:
        key = (guided.kind, guided.spec)
        with self._lock:
            template = self._templates.pop(key, None)
            if template is None:
                template = llguidance.LLMatcher(self._read_tokenizer(), grammar(guided))
                if template.is_error():
                    raise ValueError(
                        f"the {guided.kind} constraint is invalid: {template.get_error()}"
                    )
            self._templates[key] = template  # the newest
            if len(self._templates) > CACHED_GRAMMARS:
                del self._templates[next(iter(self._templates))]
            return template

    def _read_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            text = (self.model_dir / "tokenizer.json").read_text()
            self._tokenizer = llguidance.LLTokenizer(
                text, n_vocab=self.vocab_size, eos_token=self.eos
            )
        return self._tokenizer

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, llguidance.LLMatcher]]) -> None:
        """Mask, in place, the tokens each row's matcher does not allow next."""
        ops = _compiled_mask_ops(self.vocab_size)
        bitmask = ops.allocate_token_bitmask(len(rows), self.vocab_size)
        for k, (_, matcher) in enumerate(rows):
            ops.fill_next_token_bitmask(matcher, bitmask, k)
        index = torch.tensor([row for row, _ in rows], dtype=torch.long)
        masked = logits[index].float()
        ops.apply_token_bitmask_inplace(masked, bitmask.to(masked.device))
        logits[index] = masked.to(logits.dtype)


@functools.cache
def _compiled_mask_ops(vocab_size: int) -> ModuleType:
    """llguidance's torch helpers, their mask kernel run once on a row of `vocab_size` (which
    compiles it: the compiled kernel is the process's, not an instance's)."""
    import llguidance.torch

    logits = torch.zeros(1, vocab_size)
    bitmask = llguidance.torch.allocate_token_bitmask(*logits.shape)
    llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
    return llguidance.torch
