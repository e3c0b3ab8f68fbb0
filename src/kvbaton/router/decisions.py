"""A router's last decisions, for the cluster page (`GET /v1/cluster`, docs/cluster.md).

- A decision is recorded each time a worker takes a request (`Route.start(worker)`): a request
  that a refusal passed on is recorded at each worker that took it.
- At most `DecisionLog.size` decisions are kept, newest last; recording one costs O(1).
- The runner-up is the best-ranked worker other than the chosen one (None: no other ranked).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Choice:
    worker_id: int
    overlap_blocks: int | None  # None: the router does not know it (not KV-aware)
    cost: float | None  # the KV router's cost (cost.py); None for the other routers


@dataclass(frozen=True, slots=True)
class Decision:
    at: float  # seconds since the epoch
    chosen: Choice
    runner_up: Choice | None


class DecisionLog:
    size = 50

    def __init__(self) -> None:
        self._last: collections.deque[Decision] = collections.deque(maxlen=self.size)

    def record(
        self,
        chosen: int,
        ranking: list[int],
        overlaps: dict[int, int],
        costs: dict[int, float],
    ) -> None:
        """`chosen` took the request that was ranked `ranking` (each worker's known overlap
        and cost, where the router has them)."""

        def choice(worker: int) -> Choice:
            return Choice(worker, overlaps.get(worker), costs.get(worker))

        runner_up = next((w for w in ranking if w != chosen), None)
        self._last.append(
            Decision(time.time(), choice(chosen), None if runner_up is None else choice(runner_up))
        )

    def last(self) -> list[Decision]:
        """The kept decisions, oldest first."""
        return list(self._last)
