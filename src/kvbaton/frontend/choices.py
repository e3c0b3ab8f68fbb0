"""A request's choices (OpenAI's `n`): each prompt prefilled once, its KV shared by its choices
(as vLLM V1 does: child requests that meet the prompt's blocks in the prefix cache).

A prompt's choices, in order:
1. its first choice is routed as any request (disaggregated, if the prompt calls for it);
2. at that choice's first output from the worker that decodes it, the prompt's full KV blocks
   are in that worker's prefix cache (computed there, or received from a prefill worker and
   registered as they landed): its `PromptHome` names the worker;
3. the other choices are sent then, ranked with that worker first (a preference, not a pin: the
   router's ranking follows it), and prefilled there without a prefill worker: the prefix cache
   gives them the prompt's full blocks by reference count, only its last partial block is
   computed again. So a disaggregated prompt's KV moves once for all its choices.

Invariants:
- at most `MAX_CHOICES` choices per request; more is a 400 naming `n`;
- choice i of prompt p has index p * n + i (OpenAI's and vLLM's order);
- with a `seed`, choice i samples with seed + i: the choices differ, the answer repeats;
- every choice migrates on its own, like any request (it is pinned only by the request's
  `nvext.backend_instance_id`); the first error of any choice fails the request, and a client
  that leaves cancels every choice at its worker (`app._merge`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec

from kvbaton.protocols.llm import PreprocessedRequest

MAX_CHOICES = 16  # `n` at most: a request's choices cost a sequence slot each on one worker


def fork_requests(requests: list[PreprocessedRequest], n: int) -> list[PreprocessedRequest]:
    """Each prompt's request `n` times, in index order; choice i's seed is the seed + i."""
    return [_seeded(request, i) for request in requests for i in range(n)]


def _seeded(request: PreprocessedRequest, offset: int) -> PreprocessedRequest:
    seed = request.sampling.seed
    if offset == 0 or seed is None:
        return request
    sampling = msgspec.structs.replace(request.sampling, seed=seed + offset)
    return msgspec.structs.replace(request, sampling=sampling)


class PromptHome:
    """The worker that decodes a prompt's first choice, once known; None if that choice ended
    without one (a prefill worker's answer that stopped at its first token).

    - The first report counts; later ones change nothing."""

    def __init__(self) -> None:
        self._known = asyncio.Event()
        self.worker: int | None = None

    def found(self, worker: int | None) -> None:
        if not self._known.is_set():
            self.worker = worker
            self._known.set()

    async def wait(self) -> int | None:
        await self._known.wait()
        return self.worker


@dataclass(frozen=True)
class Fork:
    """A choice's part among its prompt's choices: the first (`leads`) is routed as any request
    and reports its `home`; the others try the home first, are not prefilled on a prefill
    worker there, and are never shed (their request was admitted with the first)."""

    home: PromptHome
    leads: bool
