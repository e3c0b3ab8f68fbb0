"""Which workers cache which KV blocks: the router's index, fed by the workers' KV events (or,
without events, by the requests the router itself sent: `ApproxKvIndexer`).

The index is a radix tree of block hashes whose nodes hold the workers caching that block.
Block hashes are chained (a block's hash covers every token before it, see
`kvbaton.llm.hashing`), so one hash names one path from the root: the tree is stored as its node
table, keyed by hash, and walking a request's path is one lookup per block. A node's workers are
a bit mask over worker slots, so the walk narrows the set of matching workers with one `&`.

Invariants: `find_matches` reports, for each worker caching the request's first block, how many
leading blocks of the request it caches, no more; a worker's slot is in no node once it is
removed, so a removed worker is never reported; `tree_size(w)` is the number of blocks indexed
for w.

KV tiers (events of tier host or disk): a worker's host-memory blocks are its own; disk blocks
belong to a store that every worker naming it shares (the workers of a host on one directory).
`credited_overlaps` walks the request's blocks for each worker: a block in its pool counts 1,
else in its host tier `credits.host`, else in its store `credits.disk`; the first block it
cannot get ends its walk.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvbaton.protocols.kv import (
    DEVICE,
    DISK,
    HOST,
    AllBlocksCleared,
    BlockStored,
    KvDump,
    KvEvent,
)


@dataclass(frozen=True)
class TierCredits:
    """What a block in a tier below the pool is worth to the router, a pool block being 1
    (Dynamo's defaults, to start)."""

    host: float = 0.75
    disk: float = 0.25

    def __post_init__(self) -> None:
        if not (0 <= self.disk <= self.host <= 1):
            raise ValueError("tier credits must satisfy 0 <= disk <= host <= 1")


class KvIndexer:
    def __init__(self) -> None:
        self._nodes: dict[int, int] = {}  # block hash -> mask of worker slots caching it
        self._slot_of: dict[int, int] = {}  # worker id -> its bit
        self._worker_at: dict[int, int] = {}  # bit -> worker id
        self._free_slots: list[int] = []
        self._blocks: dict[int, set[int]] = {}  # worker id -> hashes it caches
        self._host: dict[int, set[int]] = {}  # worker id -> hashes in its host tier
        self._stores: dict[str, set[int]] = {}  # disk store -> hashes in it
        self._store_of: dict[int, str] = {}  # worker id -> its disk store

    # -- updates -----------------------------------------------------------------------------
    def apply(self, worker_id: int, event: KvEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self.clear(worker_id)
            return
        tier = event.tier
        if tier == DEVICE:
            if isinstance(event, BlockStored):
                self.store(worker_id, event.block_hashes)
            else:
                self.remove(worker_id, event.block_hashes)
            return
        if tier == HOST:
            hashes = self._host.setdefault(worker_id, set())
        elif tier == DISK and event.store is not None:
            self._store_of[worker_id] = event.store
            hashes = self._stores.setdefault(event.store, set())
        else:
            return  # a tier this router does not know
        if isinstance(event, BlockStored):
            hashes.update(event.block_hashes)
        else:
            hashes.difference_update(event.block_hashes)

    def load_dump(self, worker_id: int, dump: KvDump) -> None:
        """Replace what is indexed of the worker by its dump (its store's blocks too)."""
        self.clear(worker_id)
        self.store(worker_id, dump.block_hashes)
        if dump.host_block_hashes:
            self._host[worker_id] = set(dump.host_block_hashes)
        else:
            self._host.pop(worker_id, None)
        if dump.store is not None:
            self._store_of[worker_id] = dump.store
            self._stores[dump.store] = set(dump.store_block_hashes)

    def store(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        bit = 1 << self._slot(worker_id)
        owned = self._blocks[worker_id]
        nodes = self._nodes
        for h in block_hashes:
            if h not in owned:
                owned.add(h)
                nodes[h] = nodes.get(h, 0) | bit

    def remove(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        owned = self._blocks.get(worker_id)
        if owned is None:
            return
        keep = ~(1 << self._slot_of[worker_id])
        nodes = self._nodes
        for h in block_hashes:
            if h in owned:
                owned.discard(h)
                mask = nodes[h] & keep
                if mask:
                    nodes[h] = mask
                else:
                    del nodes[h]

    def clear(self, worker_id: int) -> None:
        """Forget every block of the worker; it stays known (an empty tree)."""
        owned = self._blocks.get(worker_id)
        if owned:
            self.remove(worker_id, list(owned))

    def remove_worker(self, worker_id: int) -> None:
        """Forget the worker and free its slot (and its store once no worker names it)."""
        self._host.pop(worker_id, None)
        store = self._store_of.pop(worker_id, None)
        if store is not None and store not in self._store_of.values():
            self._stores.pop(store, None)
        if worker_id not in self._slot_of:
            return
        self.clear(worker_id)
        slot = self._slot_of.pop(worker_id)
        del self._worker_at[slot]
        del self._blocks[worker_id]
        self._free_slots.append(slot)

    def _slot(self, worker_id: int) -> int:
        slot = self._slot_of.get(worker_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot_of)
            self._slot_of[worker_id] = slot
            self._worker_at[slot] = worker_id
            self._blocks[worker_id] = set()
        return slot

    # -- queries -----------------------------------------------------------------------------
    def find_matches(self, block_hashes: Sequence[int]) -> dict[int, int]:
        """Worker id -> number of leading blocks of `block_hashes` it caches (workers with at
        least one)."""
        nodes = self._nodes
        scores: dict[int, int] = {}
        running = -1  # every slot
        depth = 0
        for h in block_hashes:
            mask = nodes.get(h, 0) & running
            if mask != running:
                if depth:
                    self._score(running & ~mask, depth, scores)
                running = mask
                if not mask:
                    return scores
            depth += 1
        if depth and running:
            self._score(running, depth, scores)
        return scores

    def _score(self, mask: int, depth: int, scores: dict[int, int]) -> None:
        worker_at = self._worker_at
        while mask:
            low = mask & -mask
            worker = worker_at.get(low.bit_length() - 1)
            if worker is not None:
                scores[worker] = depth
            mask ^= low

    @property
    def has_tiers(self) -> bool:
        """Some worker reported blocks below its pool."""
        return bool(self._store_of) or any(self._host.values())

    def credited_overlaps(
        self, block_hashes: Sequence[int], workers: Iterable[int], credits: TierCredits
    ) -> dict[int, float]:
        """Worker id -> the leading blocks of `block_hashes` it can get, each counted by its
        tier's credit (workers with at least one)."""
        nodes = self._nodes
        out: dict[int, float] = {}
        for worker in workers:
            slot = self._slot_of.get(worker)
            bit = 0 if slot is None else 1 << slot
            host = self._host.get(worker, set())
            store = self._stores.get(self._store_of.get(worker, ""), set())
            total = 0.0
            for h in block_hashes:
                if nodes.get(h, 0) & bit:
                    total += 1.0
                elif h in host:
                    total += credits.host
                elif h in store:
                    total += credits.disk
                else:
                    break
            if total:
                out[worker] = total
        return out

    def tier_sizes(self, worker_id: int) -> dict[str, int]:
        """Blocks indexed below the worker's pool, by tier (disk: its store's)."""
        sizes = {}
        if worker_id in self._host:
            sizes[HOST] = len(self._host[worker_id])
        store = self._store_of.get(worker_id)
        if store is not None:
            sizes[DISK] = len(self._stores.get(store, ()))
        return sizes

    def tree_size(self, worker_id: int) -> int:
        return len(self._blocks.get(worker_id, ()))

    @property
    def workers(self) -> list[int]:
        return list(self._slot_of)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks indexed (a block cached by several workers counts once)."""
        return len(self._nodes)


class ApproxKvIndexer(KvIndexer):
    """The index without KV events: the blocks of each request the router sent to a worker are
    taken as cached there for `ttl_s` seconds after the last request that used them."""

    def __init__(self, ttl_s: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.ttl_s = ttl_s
        self._clock = clock
        self._expiry: OrderedDict[tuple[int, int], float] = OrderedDict()  # oldest first

    def record_routed(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        expires = self._clock() + self.ttl_s
        new = []
        for h in block_hashes:
            key = (worker_id, h)
            if key in self._expiry:
                self._expiry.move_to_end(key)
            else:
                new.append(h)
            self._expiry[key] = expires
        self.store(worker_id, new)

    def prune(self) -> None:
        now = self._clock()
        expiry = self._expiry
        while expiry:
            (worker_id, h), expires = next(iter(expiry.items()))
            if expires > now:
                return
            self.remove(worker_id, (h,))

    def find_matches(self, block_hashes: Sequence[int]) -> dict[int, int]:
        self.prune()
        return super().find_matches(block_hashes)

    def remove(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """Also forgets their expiry (clear and remove_worker come here too), so that a block
        routed again is indexed again."""
        hashes = list(block_hashes)
        for h in hashes:
            self._expiry.pop((worker_id, h), None)
        super().remove(worker_id, hashes)
