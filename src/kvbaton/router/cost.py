"""The KV router's cost of sending a request to a worker, and the ranking built from it.

cost = overlap_weight * prefill_blocks + decode_blocks, where
- prefill_blocks: the request's prompt blocks the worker does not cache (less the credited
  blocks it can load from the tiers below its pool: `tier_blocks`), plus the prefill the
  worker already has pending, in blocks;
- decode_blocks: the blocks the worker's active requests hold, plus the blocks this request adds
  (its blocks less the leading ones its active requests already hold).

Lower is better. The default overlap weight, 8, prices a prompt block to compute at eight
active blocks: the mocker's timing (Dynamo's defaults) charges ~1 ms to prefill a 64-token block
and ~0.003 ms per decode step to keep one more block active, and a block prefilled now delays
every request queued behind it, while an active block only slows decode steps a little until
the KV cache is nearly full. (Dynamo's default is 1; with it, on bench/routing.py, the router
gives up cache hits for small load differences: 84% of the best hit rate instead of 99%, and a
TTFT p90 no better than round-robin's; see docs/benchmarks-log.md.)

Ties go to the worker with the smaller tree (fewer cached blocks: more room), then to the
candidates' order. With a temperature above 0 the first choice is drawn with
probability proportional to exp(-normalized cost / temperature) instead.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_OVERLAP_WEIGHT = 8.0


@dataclass(frozen=True)
class Candidate:
    worker_id: int
    overlap_blocks: int  # leading blocks of the request the worker caches
    pending_prefill_tokens: int  # prefill the worker has queued or running
    active_blocks: int  # blocks held by the worker's active requests
    shared_blocks: int  # leading blocks of the request its active requests already hold
    tree_size: int  # blocks the worker caches
    tier_blocks: float = 0.0  # blocks after `overlap_blocks` it can load from its tiers, credited


def kv_cost(c: Candidate, prompt_tokens: int, block_size: int, overlap_weight: float) -> float:
    new_tokens = max(0.0, prompt_tokens - (c.overlap_blocks + c.tier_blocks) * block_size)
    prefill_blocks = (new_tokens + c.pending_prefill_tokens) / block_size
    request_blocks = -(-prompt_tokens // block_size)
    decode_blocks = c.active_blocks + request_blocks - c.shared_blocks
    return overlap_weight * prefill_blocks + decode_blocks


def rank(
    candidates: Sequence[Candidate],
    costs: Sequence[float],
    temperature: float = 0.0,
    rng: random.Random | None = None,
) -> list[int]:
    """Worker ids, best first (`costs[i]` is the cost of `candidates[i]`)."""
    order = sorted(range(len(candidates)), key=lambda i: (costs[i], candidates[i].tree_size))
    if temperature > 0 and len(order) > 1:
        low, high = min(costs), max(costs)
        span = (high - low) or 1.0
        weights = [math.exp(-(costs[i] - low) / span / temperature) for i in order]
        first = (rng or random).choices(order, weights)[0]
        order.remove(first)
        order.insert(0, first)
    return [candidates[i].worker_id for i in order]
