"""The router's own count of the work it sent to each worker and that has not finished, so that
a burst between two load reports is not all sent to one worker.

A request is added when it is routed (its uncached prompt tokens are pending prefill, its blocks
active), its prefill is done at its first token, and it is freed at its end. Active blocks of a
worker are counted once however many of its requests share them (a shared prefix is one set of
blocks in the worker's cache), plus one partial block per request.

Invariant: once every request added is freed, every count is zero and nothing is held.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass
class _Active:
    worker_id: int
    block_hashes: Sequence[int]
    prefill_tokens: int  # pending until the first token


class ActiveSequences:
    def __init__(self) -> None:
        self._requests: dict[Hashable, _Active] = {}
        self._prefill: dict[int, int] = {}  # worker -> pending prefill tokens
        self._refs: dict[int, dict[int, int]] = {}  # worker -> block hash -> requests using it
        self._partial: dict[int, int] = {}  # worker -> requests (one partial block each)

    def add(
        self, request: Hashable, worker_id: int, block_hashes: Sequence[int], prefill_tokens: int
    ) -> None:
        if request in self._requests:
            self.free(request)
        self._requests[request] = _Active(worker_id, block_hashes, prefill_tokens)
        self._prefill[worker_id] = self._prefill.get(worker_id, 0) + prefill_tokens
        refs = self._refs.setdefault(worker_id, {})
        for h in block_hashes:
            refs[h] = refs.get(h, 0) + 1
        self._partial[worker_id] = self._partial.get(worker_id, 0) + 1

    def prefill_done(self, request: Hashable) -> None:
        active = self._requests.get(request)
        if active is not None:
            self._prefill_done(active)

    def _prefill_done(self, active: _Active) -> None:
        self._prefill[active.worker_id] -= active.prefill_tokens
        active.prefill_tokens = 0

    def free(self, request: Hashable) -> None:
        active = self._requests.pop(request, None)
        if active is None:
            return
        worker = active.worker_id
        self._prefill_done(active)
        refs = self._refs[worker]
        for h in active.block_hashes:
            n = refs[h] - 1
            if n:
                refs[h] = n
            else:
                del refs[h]
        self._partial[worker] -= 1
        if not self._partial[worker]:
            del self._partial[worker], self._refs[worker], self._prefill[worker]

    # -- queries -----------------------------------------------------------------------------
    def prefill_tokens(self, worker_id: int) -> int:
        return self._prefill.get(worker_id, 0)

    def active_blocks(self, worker_id: int) -> int:
        return len(self._refs.get(worker_id, ())) + self._partial.get(worker_id, 0)

    def shared_prefix_blocks(self, worker_id: int, block_hashes: Sequence[int]) -> int:
        """Leading blocks of a request that the worker's active requests already hold."""
        refs = self._refs.get(worker_id)
        if not refs:
            return 0
        n = 0
        for h in block_hashes:
            if h not in refs:
                break
            n += 1
        return n

    def requests(self, worker_id: int) -> int:
        return self._partial.get(worker_id, 0)

    def __len__(self) -> int:
        return len(self._requests)
