"""A thinking budget (`SamplingParams.thinking_budget`) as a sequence is sampled: once its
reasoning holds `tokens` tokens, the closing tag's tokens are placed, one a step, whatever the
model would have drawn.

- The state follows every token generated so far, those generated elsewhere too (a prefill
  worker's first token, a migrated request's replayed tail), each looked at once.
- The reasoning starts at the output's start (no `start` ids), or after `start` where the
  output opens with it; an output that does not has no reasoning, and nothing is placed.
- It ends at the first `end` in it (the model's, or the placed one once whole).
- Past the budget, the tag is finished from where the output stands: a start of it that ends
  the output is kept (the model's or a placed one), the rest placed. Reasoning that arrives
  already past the budget (from an engine that did not enforce it) is closed the same way.
"""

from __future__ import annotations

from kvbaton.protocols.llm import ThinkingBudget


class ThinkingState:
    def __init__(self, budget: ThinkingBudget) -> None:
        self.budget = budget
        self._begin: int | None = None if budget.start else 0  # of the reasoning, generated
        self._over = False  # ended, or never started
        self._seen = 0  # generated tokens looked at

    def placed(self, token_ids: list[int], first: int) -> int | None:
        """The token to place next, or None to let the model draw: `token_ids[first:]` are
        every token generated so far."""
        budget, end = self.budget, self.budget.end
        for i in range(self._seen, len(token_ids) - first):
            if self._over:
                break
            token = token_ids[first + i]
            if self._begin is None:
                if token != budget.start[i]:
                    self._over = True  # it opened otherwise: no reasoning
                elif i + 1 == len(budget.start):
                    self._begin = i + 1
            elif (at := i + 1 - len(end)) >= self._begin and (
                token_ids[first + at : first + i + 1] == end
            ):
                self._over = True
        self._seen = len(token_ids) - first
        if self._over or self._begin is None or self._seen - self._begin < budget.tokens:
            return None
        return end[_started(token_ids, first + self._begin, end)]


def _started(token_ids: list[int], first: int, end: list[int]) -> int:
    """How much of `end` (less than all of it) ends `token_ids[first:]`."""
    for n in range(min(len(end) - 1, len(token_ids) - first), 0, -1):
        if token_ids[len(token_ids) - n :] == end[:n]:
            return n
    return 0
