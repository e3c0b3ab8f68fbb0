"""A thinking budget (`SamplingParams.thinking_budget`) as a sequence is sampled: once its
reasoning holds `tokens` tokens, the closing tag is placed, whatever the model would have
drawn.

- The state follows every token generated so far, those generated elsewhere too (a prefill
  worker's first token, a migrated request's replayed tail), each looked at once.
- The reasoning starts at the output's start (no `start`), or after `start` where the output
  opens with it; an output that does not has no reasoning, and nothing is placed.
- It ends at the first `end` in it (the model's, or the placed one). Reasoning that arrives
  already past the budget (from an engine that did not enforce it) is closed at once.
"""

from __future__ import annotations

from kvbaton.protocols.llm import ThinkingBudget


class ThinkingState:
    def __init__(self, budget: ThinkingBudget) -> None:
        self.budget = budget
        self._begin: int | None = None if budget.start is not None else 0  # of the reasoning
        self._over = False  # ended, or never started
        self._seen = 0  # generated tokens looked at

    def placed(self, token_ids: list[int], first: int) -> int | None:
        """The token to place next, or None to let the model draw: `token_ids[first:]` are
        every token generated so far."""
        budget = self.budget
        for i in range(self._seen, len(token_ids) - first):
            if self._over:
                break
            token = token_ids[first + i]
            if self._begin is not None:
                self._over = token == budget.end
            elif token == budget.start:
                self._begin = 1
            else:
                self._over = True  # it opened otherwise: no reasoning
        self._seen = len(token_ids) - first
        if self._over or self._begin is None or self._seen - self._begin < budget.tokens:
            return None
        return budget.end
