"""The block manager alone, on tiny sizes: reference counts, prefix cache, LRU, events."""

from __future__ import annotations

import pytest

from kvbaton.engine.block_manager import BlockManager
from kvbaton.engine.sequence import Sequence
from kvbaton.llm.hashing import hash_blocks
from kvbaton.protocols.kv import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from kvbaton.protocols.llm import SamplingParams

pytestmark = pytest.mark.unit
BS = 4


def seq(tokens: list[int], rid: str = "r", **kw: object) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), **kw)  # type: ignore[arg-type]


def manager(num_blocks: int = 8) -> tuple[BlockManager, list[KvEvent]]:
    events: list[KvEvent] = []
    return BlockManager(num_blocks, BS, True, events.append), events


def run(bm: BlockManager, s: Sequence) -> None:
    """Admit `s` as the scheduler would: prefix hits, then compute the rest."""
    hits = bm.match_prefix(s)
    assert bm.allocate(s, s.num_tokens - len(hits) * BS, hits)
    s.num_computed_tokens = s.num_tokens


def test_allocation_covers_the_tokens_and_frees_back() -> None:
    bm, _ = manager()
    s = seq(list(range(10)))
    run(bm, s)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_free_blocks == 5
    bm.deallocate(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_full_blocks_are_cached_and_shared_by_a_later_prompt() -> None:
    bm, events = manager()
    a = seq(list(range(10)), "a")
    run(bm, a)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [hash_blocks(list(range(10)), BS)]
    assert stored[0].parent_hash is None and stored[0].token_ids == list(range(8))
    b = seq([*range(8), 99, 98, 97], "b")
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, b.num_tokens - 8, hits)
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    assert bm.num_free_blocks == 8 - 3 - 1


def test_at_least_one_token_is_left_to_compute() -> None:
    bm, _ = manager()
    run(bm, seq(list(range(8)), "a"))
    again = seq(list(range(8)), "b")
    assert len(bm.match_prefix(again)) == 1  # not 2: the last token must run


def test_free_cached_blocks_are_reused_lru_and_evictions_are_events() -> None:
    bm, events = manager(num_blocks=4)
    a = seq(list(range(8)), "a")
    run(bm, a)
    bm.deallocate(a)  # both blocks free, still cached
    assert bm.stats().cached == 2
    b = seq(list(range(100, 112)), "b")  # needs 3 blocks: 2 untouched, then the oldest cached
    run(bm, b)
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    # a freed its tail block first, so the tail was evicted first
    assert removed[0].block_hashes == [hash_blocks(list(range(8)), BS)[1]]
    assert [e.event_id for e in events] == list(range(len(events)))


def test_allocation_fails_without_changing_anything() -> None:
    bm, _ = manager(num_blocks=2)
    s = seq(list(range(9)))
    assert not bm.allocate(s, 9)
    assert bm.num_free_blocks == 2 and s.block_table == []


def test_salted_blocks_never_match_plain_or_other_salts() -> None:
    bm, _ = manager()
    run(bm, seq(list(range(9)), "plain"))
    assert bm.match_prefix(seq(list(range(9)), "salted", cache_salt="s")) == []
    run(bm, seq(list(range(9)), "salted-t", cache_salt="t"))
    assert bm.match_prefix(seq(list(range(9)), "salted-s", cache_salt="s")) == []


def test_clear_forgets_every_prefix() -> None:
    bm, events = manager()
    s = seq(list(range(9)))
    run(bm, s)
    assert bm.clear_kv_blocks() == 2
    assert isinstance(events[-1], AllBlocksCleared)
    assert bm.match_prefix(seq(list(range(9)), "again")) == []
    bm.deallocate(s)
    assert bm.num_free_blocks == 8


def test_hashes_are_stable_across_processes() -> None:
    """A router in another process computes the same values: they are fixed here."""
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4) == [
        hash_blocks([1, 2, 3, 4], 4)[0],
        hash_blocks([5, 6, 7, 8], 4, parent_hash=hash_blocks([1, 2, 3, 4], 4)[0])[0],
    ]
    # Golden values: a change here breaks every router and worker that disagree on them.
    assert hash_blocks([1, 2, 3, 4], 4) == [0x09222804E3E39BA2]
    assert hash_blocks(list(range(32)), 16, ("salt", "x"))[1] == 0xB6787B5A0BE536CC
