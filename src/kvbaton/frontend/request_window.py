"""The last minutes of a frontend's requests in fixed steps, for the cluster page's charts
(`GET /v1/cluster`, docs/cluster.md).

- Time is cut into buckets of `step_s` seconds since the epoch; buckets older than `span_s` are
  dropped as new ones open, so memory stays bounded.
- A bucket counts the requests that ended in it (and those that failed: status >= 400) and keeps
  at most `SAMPLES` TTFT and ITL samples each (reservoir sampling: every sample of the bucket
  has the same chance to be kept).
- ITL is one sample per request: its mean gap between tokens.
- `points()` leaves out the bucket still open: a point's rate covers its whole step.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

SAMPLES = 512


@dataclass
class _Reservoir:
    seen: int = 0
    kept: list[float] = field(default_factory=list)

    def add(self, value: float, rng: random.Random) -> None:
        self.seen += 1
        if len(self.kept) < SAMPLES:
            self.kept.append(value)
        else:
            slot = rng.randrange(self.seen)
            if slot < SAMPLES:
                self.kept[slot] = value

    def p50_p90(self) -> tuple[float | None, float | None]:
        """The kept samples' median and 90th percentile (sorted once for both)."""
        if not self.kept:
            return None, None
        ordered = sorted(self.kept)
        n = len(ordered)
        return ordered[min(n - 1, n // 2)], ordered[min(n - 1, math.floor(0.9 * n))]


@dataclass
class _Bucket:
    ended: int = 0
    failed: int = 0
    ttft: _Reservoir = field(default_factory=_Reservoir)
    itl: _Reservoir = field(default_factory=_Reservoir)


class RequestWindow:
    def __init__(self, span_s: float = 300.0, step_s: float = 2.0) -> None:
        if step_s <= 0 or span_s < step_s:
            raise ValueError("the step must be > 0 and the span at least one step")
        self.span_s = span_s
        self.step_s = step_s
        self.ended = 0  # requests ended since the frontend started
        self._buckets: dict[int, _Bucket] = {}
        self._rng = random.Random()

    def _bucket(self, now: float) -> _Bucket:
        index = int(now // self.step_s)
        bucket = self._buckets.get(index)
        if bucket is None:
            oldest = index - int(self.span_s // self.step_s)
            for old in [i for i in self._buckets if i <= oldest]:
                del self._buckets[old]
            bucket = self._buckets[index] = _Bucket()
        return bucket

    def record(self, status: int, ttft_s: float | None, itl_s: float | None) -> None:
        """A request ended with `status`; its TTFT and mean ITL (None: it had no such)."""
        bucket = self._bucket(time.time())
        self.ended += 1
        bucket.ended += 1
        if status >= 400:
            bucket.failed += 1
        if ttft_s is not None:
            bucket.ttft.add(ttft_s, self._rng)
        if itl_s is not None:
            bucket.itl.add(itl_s, self._rng)

    def points(self, now: float | None = None) -> list[dict[str, Any]]:
        """One point per closed step of the span, oldest first: its start (`t`, seconds since
        the epoch), requests/s and failed requests/s, TTFT and ITL p50/p90 in seconds (None:
        no sample)."""
        now = time.time() if now is None else now
        current = int(now // self.step_s)
        steps = int(self.span_s // self.step_s)
        out = []
        for index in range(current - steps, current):
            bucket = self._buckets.get(index) or _Bucket()
            ttft_p50, ttft_p90 = bucket.ttft.p50_p90()
            itl_p50, itl_p90 = bucket.itl.p50_p90()
            out.append(
                {
                    "t": index * self.step_s,
                    "requests_per_s": bucket.ended / self.step_s,
                    "failed_per_s": bucket.failed / self.step_s,
                    "ttft_p50_s": ttft_p50,
                    "ttft_p90_s": ttft_p90,
                    "itl_p50_s": itl_p50,
                    "itl_p90_s": itl_p90,
                }
            )
        return out
