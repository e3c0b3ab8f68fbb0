"""The router's KV index: `KvIndexer` (fed by KV events) and `ApproxKvIndexer` (fed by the
router's own routing decisions, with a TTL), on hand-built chained block hashes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.llm.hashing import hash_blocks
from kvbaton.protocols.kv import AllBlocksCleared, BlockRemoved, BlockStored
from kvbaton.router.indexer import ApproxKvIndexer, KvIndexer

pytestmark = pytest.mark.unit
BS = 4
A, B, C = 0x7F3A_0001, 0x7F3A_0002, 0x7F3A_0003  # lease-id-like worker ids
PROMPT = list(range(100, 116))  # 4 full blocks
HASHES = hash_blocks(PROMPT, BS)


def stored(tokens: list[int], event_id: int = 0, *, start: int = 0) -> BlockStored:
    """The event a worker sends when the blocks of `tokens` from block `start` on are cached."""
    hashes = hash_blocks(tokens, BS)
    return BlockStored(
        event_id=event_id,
        block_hashes=hashes[start:],
        parent_hash=hashes[start - 1] if start else None,
        token_ids=tokens[start * BS : len(hashes) * BS],
        block_size=BS,
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- KvIndexer ------------------------------------------------------------------------------


def test_longest_prefix_per_worker() -> None:
    """A caches 3 leading blocks, B 1: each is reported with its own prefix length."""
    ix = KvIndexer()
    ix.store(A, HASHES[:3])
    ix.store(B, HASHES[:1])
    assert ix.find_matches(HASHES) == {A: 3, B: 1}
    assert ix.find_matches(HASHES[:2]) == {A: 2, B: 1}
    assert ix.find_matches([]) == {}


def test_a_worker_without_the_first_block_is_not_reported() -> None:
    """Blocks after a gap do not count: only leading blocks are a usable prefix."""
    ix = KvIndexer()
    ix.store(A, HASHES[1:])  # everything but the first block
    ix.store(B, [HASHES[0], HASHES[2], HASHES[3]])  # a hole at block 1
    assert ix.find_matches(HASHES) == {B: 1}


def test_a_different_first_block_changes_every_later_hash() -> None:
    """Chained hashes: the same tokens after a different first block never match."""
    ix = KvIndexer()
    ix.store(A, HASHES)
    other = hash_blocks([999, *PROMPT[1:]], BS)
    assert set(other).isdisjoint(HASHES)
    assert ix.find_matches(other) == {}
    assert ix.find_matches(hash_blocks([*PROMPT[:8], 1, 2, 3, 4], BS)) == {A: 2}


def test_events_store_remove_and_clear() -> None:
    """apply() follows BlockStored, BlockRemoved (suffix) and AllBlocksCleared."""
    ix = KvIndexer()
    ix.apply(A, stored(PROMPT[:8], 0))
    ix.apply(A, stored(PROMPT, 1, start=2))  # the next two blocks, parent = block 1
    ix.apply(B, stored(PROMPT, 0))
    assert ix.find_matches(HASHES) == {A: 4, B: 4}
    ix.apply(A, BlockRemoved(event_id=2, block_hashes=HASHES[2:]))
    assert ix.find_matches(HASHES) == {A: 2, B: 4}
    assert ix.tree_size(A) == 2
    ix.apply(B, AllBlocksCleared(event_id=1))
    assert ix.find_matches(HASHES) == {A: 2}
    assert ix.tree_size(B) == 0 and B in ix.workers  # cleared, still known


def test_removing_unknown_blocks_or_workers_is_harmless() -> None:
    ix = KvIndexer()
    ix.store(A, HASHES[:2])
    ix.remove(A, [12345, HASHES[3]])  # never stored
    ix.remove(B, HASHES)  # unknown worker
    ix.clear(C)
    ix.remove_worker(C)
    assert ix.find_matches(HASHES) == {A: 2}
    assert ix.workers == [A] and ix.tree_size(A) == 2


def test_storing_a_block_twice_counts_it_once() -> None:
    ix = KvIndexer()
    ix.store(A, HASHES[:2])
    ix.store(A, [HASHES[0], HASHES[1], HASHES[1]])
    assert ix.tree_size(A) == 2 and ix.num_blocks == 2
    ix.remove(A, HASHES[1:2])
    assert ix.find_matches(HASHES) == {A: 1}


def test_removing_one_worker_leaves_the_block_to_the_others() -> None:
    ix = KvIndexer()
    ix.store(A, HASHES)
    ix.store(B, HASHES)
    ix.remove(A, HASHES)
    assert ix.find_matches(HASHES) == {B: 4}
    assert ix.num_blocks == 4


def test_remove_worker_is_never_reported_and_its_slot_is_reused_clean() -> None:
    """A removed worker drops out; a new worker on its freed slot inherits none of its
    blocks; the old worker, if it comes back, starts empty."""
    ix = KvIndexer()
    ix.store(A, HASHES)
    ix.store(B, HASHES[:1])
    ix.remove_worker(A)
    assert ix.find_matches(HASHES) == {B: 1}
    assert A not in ix.workers and ix.tree_size(A) == 0
    assert ix.num_blocks == 1
    ix.store(C, [])  # takes A's free slot
    assert ix.find_matches(HASHES) == {B: 1}
    assert ix.tree_size(C) == 0
    ix.store(C, HASHES[:2])
    assert ix.find_matches(HASHES) == {C: 2, B: 1}
    ix.store(A, [])  # A back: a fresh, empty tree
    assert ix.find_matches(HASHES) == {C: 2, B: 1}
    assert sorted(ix.workers) == sorted([B, C, A])


def test_tree_size_and_num_blocks() -> None:
    """tree_size counts a worker's blocks; num_blocks counts distinct blocks once."""
    other = hash_blocks(list(range(500, 508)), BS)
    ix = KvIndexer()
    ix.store(A, HASHES)
    ix.store(B, HASHES[:2] + other)
    assert (ix.tree_size(A), ix.tree_size(B), ix.tree_size(C)) == (4, 4, 0)
    assert ix.num_blocks == 6
    ix.clear(A)
    assert ix.num_blocks == 4
    ix.remove_worker(B)
    assert ix.num_blocks == 0


def test_more_workers_than_64_bits() -> None:
    """70 workers, worker i caching i % 4 + 1 leading blocks; remove some, add more."""
    ix = KvIndexer()
    workers = [0x1000 + i for i in range(70)]
    for i, w in enumerate(workers):
        ix.store(w, HASHES[: i % 4 + 1])
    assert ix.find_matches(HASHES) == {w: i % 4 + 1 for i, w in enumerate(workers)}
    gone = workers[60:70:2] + workers[:3]
    for w in gone:
        ix.remove_worker(w)
    newcomers = [0x2000 + i for i in range(10)]
    for w in newcomers:
        ix.store(w, HASHES[:1])
    expected = {w: i % 4 + 1 for i, w in enumerate(workers) if w not in gone}
    expected |= dict.fromkeys(newcomers, 1)
    assert ix.find_matches(HASHES) == expected
    assert ix.find_matches(HASHES[:1]) == dict.fromkeys(expected, 1)


# -- ApproxKvIndexer ------------------------------------------------------------------------


def test_approx_routed_blocks_match_until_the_ttl() -> None:
    clock = FakeClock()
    ix = ApproxKvIndexer(ttl_s=10.0, clock=clock)
    ix.record_routed(A, HASHES[:3])
    assert ix.find_matches(HASHES) == {A: 3}
    clock.now += 9.5
    assert ix.find_matches(HASHES) == {A: 3}
    clock.now += 1.0
    assert ix.find_matches(HASHES) == {}
    assert ix.tree_size(A) == 0


def test_approx_rerecording_refreshes_the_expiry() -> None:
    """Blocks used again are kept ttl_s after their last use; the others still expire."""
    clock = FakeClock()
    ix = ApproxKvIndexer(ttl_s=10.0, clock=clock)
    ix.record_routed(A, HASHES)
    clock.now += 6.0
    ix.record_routed(A, HASHES[:2])
    ix.record_routed(B, HASHES[:1])
    clock.now += 6.0  # 12 s after the first request, 6 s after the second
    assert ix.find_matches(HASHES) == {A: 2, B: 1}
    assert ix.tree_size(A) == 2
    clock.now += 6.0
    assert ix.find_matches(HASHES) == {}


def test_approx_remove_worker_clears_its_blocks_and_timers() -> None:
    clock = FakeClock()
    ix = ApproxKvIndexer(ttl_s=10.0, clock=clock)
    ix.record_routed(A, HASHES)
    ix.record_routed(B, HASHES[:2])
    ix.remove_worker(A)
    assert ix.find_matches(HASHES) == {B: 2}
    ix.record_routed(C, HASHES[:1])  # may take A's slot
    assert ix.find_matches(HASHES) == {B: 2, C: 1}
    clock.now += 20.0
    assert ix.find_matches(HASHES) == {}
    assert ix.num_blocks == 0


def test_approx_blocks_routed_again_after_a_clear_match() -> None:
    """After clear() (AllBlocksCleared) the worker's blocks are gone; routing the same request
    there again must index them again."""
    ix = ApproxKvIndexer(ttl_s=10.0, clock=FakeClock())
    ix.record_routed(A, HASHES)
    ix.apply(A, AllBlocksCleared(event_id=0))
    assert ix.find_matches(HASHES) == {}
    ix.record_routed(A, HASHES)
    assert ix.find_matches(HASHES) == {A: 4}
    assert ix.tree_size(A) == 4


def test_approx_blocks_routed_again_after_a_removal_match() -> None:
    """The same after remove() (BlockRemoved) of the last two blocks."""
    ix = ApproxKvIndexer(ttl_s=10.0, clock=FakeClock())
    ix.record_routed(A, HASHES)
    ix.apply(A, BlockRemoved(event_id=0, block_hashes=HASHES[2:]))
    assert ix.find_matches(HASHES) == {A: 2}
    ix.record_routed(A, HASHES)
    assert ix.find_matches(HASHES) == {A: 4}


# -- against a reference model -------------------------------------------------------------

WORKERS = [A, B, C, 0x7F3A_0004]
# prefixes of a few related prompts (so workers often share blocks), or random small-alphabet
BASES = [[0] * 12, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [0, 0, 2, 2, 0, 0, 2, 2, 1, 1, 1, 1]]
tokens_st = st.one_of(
    st.builds(lambda base, n: base[:n], st.sampled_from(BASES), st.integers(2, 12)),
    st.lists(st.integers(0, 2), max_size=12),
)


@dataclass
class Op:
    kind: str
    worker: int
    tokens: list[int]
    start: int  # first block of the tokens' blocks the op touches


op_st = st.builds(
    Op,
    kind=st.sampled_from(["store", "store", "store", "remove", "clear", "remove_worker"]),
    worker=st.sampled_from(WORKERS),
    tokens=tokens_st,
    start=st.sampled_from([0, 0, 0, 1, 2, 3]),
)


def leading(hashes: list[int], cached: set[int]) -> int:
    n = 0
    for h in hashes:
        if h not in cached:
            break
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op_st, min_size=4, max_size=30), queries=st.lists(tokens_st, max_size=3))
def test_find_matches_agrees_with_a_reference_model(
    ops: list[Op], queries: list[list[int]]
) -> None:
    """After every operation, find_matches, tree_size, num_blocks and workers equal those of
    a dict of worker -> set of hashes (overlap = leading hashes in the set)."""
    ix = KvIndexer()
    model: dict[int, set[int]] = {}
    for i, op in enumerate(ops):
        full = hash_blocks(op.tokens, BS)
        start = min(op.start, len(full))
        hashes = full[start:]
        if op.kind == "store":
            ix.apply(op.worker, stored(op.tokens, i, start=start))
            model.setdefault(op.worker, set()).update(hashes)
        elif op.kind == "remove":
            ix.apply(op.worker, BlockRemoved(event_id=i, block_hashes=hashes))
            if op.worker in model:
                model[op.worker] -= set(hashes)
        elif op.kind == "clear":
            ix.apply(op.worker, AllBlocksCleared(event_id=i))
            if op.worker in model:
                model[op.worker] = set()
        else:
            ix.remove_worker(op.worker)
            model.pop(op.worker, None)
        for q in [*BASES, op.tokens, *queries]:
            qh = hash_blocks(q, BS)
            expected = {w: n for w, s in model.items() if (n := leading(qh, s))}
            assert ix.find_matches(qh) == expected
        assert sorted(ix.workers) == sorted(model)
        assert {w: ix.tree_size(w) for w in WORKERS} == {w: len(model.get(w, ())) for w in WORKERS}
        assert ix.num_blocks == len(set().union(*model.values()))
