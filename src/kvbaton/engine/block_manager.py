"""Paged KV blocks: reference counts, prefix caching by chained block hash, LRU eviction, KV
events. Knows nothing of tensors or models.

Invariants:
- A block is in `free` exactly when its reference count is 0. Free blocks may still hold a
  cached prefix (a hash); they are reused least-recently-freed first, and reuse evicts the hash
  (a BlockRemoved event).
- `cached` maps a hash to the one block registered under it; a block holds at most one hash.
- A sequence frees its blocks in reverse order, so its tail blocks are evicted first.
- Events are numbered 0, 1, 2, ... with no gap, in the order the cache changed; `emit` numbers
  and hands on an event under one lock, so a tier's thread may emit too, and `dump` is taken
  as of one event id under it.
- With `keep_evicted`, every evicted (hash, block) waits in `evicted` until taken, its block's
  bytes unchanged until the step after its eviction runs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import NamedTuple

from kvbaton.engine.sequence import Sequence
from kvbaton.llm.hashing import reusable_blocks
from kvbaton.protocols.kv import AllBlocksCleared, BlockRemoved, BlockStored, KvDump, KvEvent


class BlockStats(NamedTuple):
    total: int
    used: int  # referenced by a sequence, or quarantined (a failed load's, see Scheduler)
    free: int  # unreferenced (some still hold a reusable cached prefix)
    cached: int  # registered in the prefix cache, referenced or not


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_event: Callable[[KvEvent], None] | None = None,
        keep_evicted: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._on_event = on_event
        self._next_event_id = 0
        self._emit_lock = threading.Lock()
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.evicted: list[tuple[int, int]] | None = [] if keep_evicted else None

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def stats(self) -> BlockStats:
        free = len(self.free)
        return BlockStats(self.num_blocks, self.num_blocks - free, free, len(self.cached))

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- the five verbs ----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of a new sequence's tokens. At least one
        token is left to compute, since the model must run on the last one to sample. No
        block for one that computes its whole prompt (`computes_whole_prompt`)."""
        if not self.enable_prefix_caching or seq.computes_whole_prompt:
            return []
        max_blocks = reusable_blocks(seq.num_tokens, self.block_size)
        hits = []
        for h in seq.full_block_hashes(self.block_size, max_blocks):
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def note_prefix_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Count an admitted sequence's lookup in the hit rate (once, however often its
        admission was tried)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_cached

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()
    ) -> bool:
        return self._new_blocks_needed(seq, num_new_tokens, cached_blocks) <= len(self.free) - sum(
            1 for b in cached_blocks if self.ref_counts[b] == 0
        )

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_blocks: Seq[int] = (),
        register: bool = True,
    ) -> bool:
        """Give `seq` blocks for its computed tokens, then `cached_blocks` (prefix hits, for a
        sequence with no blocks yet), then `num_new_tokens` more. False, changing nothing, if
        there are not enough free blocks. Blocks that the step fills are registered in the
        prefix cache (they hold their KV before anyone can read them: after this step), unless
        `register` is False (KV that arrives later: `register_computed` once it did)."""
        assert not cached_blocks or not seq.block_table
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            return False
        needed = self._new_blocks_needed(seq, num_new_tokens, cached_blocks)
        for block in cached_blocks:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
        seq.block_table.extend(cached_blocks)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, len(cached_blocks))
        evicted: list[int] = []
        for _ in range(needed):
            block, _ = self.free.popitem(last=False)
            old = self.block_hash[block]
            if old is not None:
                del self.cached[old]
                self.block_hash[block] = None
                evicted.append(old)
                if self.evicted is not None:
                    self.evicted.append((old, block))
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        if evicted:
            self.emit(lambda i: BlockRemoved(event_id=i, block_hashes=evicted))
        if self.enable_prefix_caching and register:
            filled = seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
            self._register_full_blocks(seq, filled // self.block_size)
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Register the full blocks of the sequence's computed tokens in the prefix cache."""
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, seq.num_computed_tokens // self.block_size)

    def deallocate(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail first; its cached blocks stay reusable."""
        self.release_blocks(seq.block_table)
        seq.block_table.clear()
        seq.num_hashed_blocks = 0

    def release_blocks(self, blocks: Seq[int]) -> None:
        """Drop one reference to each block, last first (blocks taken from a table)."""
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0
            if self.ref_counts[block] == 0:
                self.free[block] = None

    def clear_kv_blocks(self) -> int:
        """Forget every cached prefix (blocks in use stay allocated); returns how many."""
        count = len(self.cached)
        for block in self.cached.values():
            self.block_hash[block] = None
        self.cached.clear()
        self.emit(lambda i: AllBlocksCleared(event_id=i))
        return count

    def take_evicted(self) -> list[tuple[int, int]]:
        """The (hash, block) evicted since the last call (none without `keep_evicted`)."""
        if not self.evicted:
            return []
        taken, self.evicted = self.evicted, []
        return taken

    def dump(self, below: Callable[[KvDump], None] | None = None) -> KvDump:
        """The cached blocks, and what `below` (a tier) adds, as of the last event."""
        with self._emit_lock:
            dump = KvDump(last_event_id=self._next_event_id - 1, block_hashes=list(self.cached))
            if below is not None:
                below(dump)
            return dump

    # -- internals ---------------------------------------------------------------------------
    def _new_blocks_needed(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int]
    ) -> int:
        total = seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        return max(0, self.blocks_needed(total) - len(seq.block_table) - len(cached_blocks))

    def _register_full_blocks(self, seq: Sequence, num_full: int) -> None:
        if num_full <= seq.num_hashed_blocks:
            return
        bs = self.block_size
        hashes = seq.full_block_hashes(bs, num_full)
        run: list[int] = []  # consecutive newly stored blocks: one event
        run_start = seq.num_hashed_blocks
        for i in range(seq.num_hashed_blocks, num_full):
            h, block = hashes[i], seq.block_table[i]
            if h in self.cached or self.block_hash[block] is not None:
                self._emit_stored(seq, hashes, run_start, run)  # someone else holds this one
                run, run_start = [], i + 1
                continue
            self.cached[h] = block
            self.block_hash[block] = h
            run.append(h)
        self._emit_stored(seq, hashes, run_start, run)
        seq.num_hashed_blocks = num_full

    def _emit_stored(self, seq: Sequence, hashes: list[int], start: int, run: list[int]) -> None:
        if not run:
            return
        bs = self.block_size
        tokens = seq.token_ids[start * bs : (start + len(run)) * bs]
        parent = hashes[start - 1] if start > 0 else None
        self.emit(
            lambda i: BlockStored(
                event_id=i,
                block_hashes=run,
                parent_hash=parent,
                token_ids=tokens,
                block_size=bs,
            )
        )

    def emit(self, make: Callable[[int], KvEvent]) -> None:
        """Number an event (`make(event_id)`) and hand it on. Any thread."""
        with self._emit_lock:
            if self._on_event is not None:
                self._on_event(make(self._next_event_id))
            self._next_event_id += 1
