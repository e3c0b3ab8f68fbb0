"""The KV router's cost and ranking (`cost.py`), and the in-flight counts that feed them
(`ActiveSequences`), on hand-computed cases."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.llm.hashing import hash_blocks
from kvbaton.router.active import ActiveSequences
from kvbaton.router.cost import Candidate, kv_cost, rank

pytestmark = pytest.mark.unit
BS = 4


def cand(
    worker_id: int,
    overlap: int = 0,
    pending: int = 0,
    active: int = 0,
    shared: int = 0,
    tree: int = 0,
) -> Candidate:
    return Candidate(
        worker_id=worker_id,
        overlap_blocks=overlap,
        pending_prefill_tokens=pending,
        active_blocks=active,
        shared_blocks=shared,
        tree_size=tree,
    )


def ranked(cands: list[Candidate], prompt_tokens: int, weight: float = 1.0) -> list[int]:
    return rank(cands, [kv_cost(c, prompt_tokens, BS, weight) for c in cands])


# -- kv_cost --------------------------------------------------------------------------------


def test_cost_by_hand() -> None:
    """cost = weight * (uncached + pending prefill) / B + active + request blocks - shared."""
    # 30 tokens: 8 blocks (7 full + a partial); 3 cached -> 18 new tokens; 6 pending
    c = cand(1, overlap=3, pending=6, active=5, shared=2)
    assert kv_cost(c, 30, BS, 1.0) == pytest.approx((18 + 6) / 4 + 5 + 8 - 2)
    assert kv_cost(c, 30, BS, 2.0) == pytest.approx(2 * 6 + 11)
    assert kv_cost(c, 30, BS, 0.0) == pytest.approx(11)
    # a cache longer than the prompt never makes the new tokens negative
    assert kv_cost(cand(1, overlap=20), 30, BS, 1.0) == pytest.approx(8)


def test_more_overlap_is_cheaper() -> None:
    assert ranked([cand(1, overlap=1), cand(2, overlap=6), cand(3, overlap=3)], 32) == [2, 3, 1]


# -- load breaks ties -----------------------------------------------------------------------


def test_equal_overlap_fewer_active_blocks_wins() -> None:
    assert ranked([cand(1, overlap=4, active=9), cand(2, overlap=4, active=2)], 32) == [2, 1]


def test_equal_overlap_less_pending_prefill_wins() -> None:
    assert ranked([cand(1, overlap=4, pending=64), cand(2, overlap=4)], 32) == [2, 1]


def test_load_can_outweigh_a_cache_hit() -> None:
    """Full cache hit but 20 active blocks (cost 28) loses to a cold idle worker (cost 16)
    at weight 1, and wins at weight 10 (cost 88 for the cold one)."""
    hot, cold = cand(1, overlap=8, active=20, tree=8), cand(2)
    assert ranked([hot, cold], 32, weight=1.0) == [2, 1]
    assert ranked([hot, cold], 32, weight=10.0) == [1, 2]


# -- ties -----------------------------------------------------------------------------------


def test_equal_cost_smaller_tree_wins_then_candidate_order() -> None:
    cands = [cand(1, tree=50), cand(2, tree=7), cand(3, tree=7), cand(4, tree=0)]
    assert ranked(cands, 32) == [4, 2, 3, 1]


def test_overlap_weight_zero_ignores_the_cache() -> None:
    """With weight 0 a cached prompt saves nothing: the costs tie and the smaller tree (the
    worker without the cache) wins."""
    hot, cold = cand(1, overlap=8, tree=8), cand(2)
    costs = [kv_cost(c, 32, BS, 0.0) for c in (hot, cold)]
    assert costs[0] == costs[1]
    assert rank([hot, cold], costs) == [2, 1]


def test_rank_of_nothing_and_of_one() -> None:
    assert rank([], []) == []
    assert rank([cand(5)], [3.0], temperature=1.0) == [5]


# -- temperature ----------------------------------------------------------------------------


def test_temperature_draws_a_permutation_favouring_the_cheapest() -> None:
    """Every draw ranks each candidate once; the rest keep cost order; over many draws the
    cheapest is first most often and the dearest least often."""
    cands = [cand(10), cand(11), cand(12), cand(13)]
    costs = [3.0, 1.0, 2.0, 9.0]
    rng = random.Random(1234)
    firsts: Counter[int] = Counter()
    for _ in range(2000):
        order = rank(cands, costs, temperature=0.5, rng=rng)
        assert sorted(order) == [10, 11, 12, 13]
        rest = [w for w in [11, 12, 10, 13] if w != order[0]]
        assert order[1:] == rest
        firsts[order[0]] += 1
    assert firsts.most_common(1)[0][0] == 11
    assert firsts[11] > firsts[12] > firsts[10] > firsts[13]
    assert firsts[13] > 0  # every candidate can be drawn


def test_temperature_zero_is_deterministic() -> None:
    cands = [cand(1), cand(2), cand(3)]
    rng = random.Random(0)
    for _ in range(20):
        assert rank(cands, [2.0, 1.0, 3.0], temperature=0.0, rng=rng) == [2, 1, 3]


def test_same_seed_same_draws() -> None:
    cands = [cand(i) for i in range(6)]
    costs = [float(i % 3) for i in range(6)]
    a, b = random.Random(7), random.Random(7)
    assert [rank(cands, costs, 2.0, a) for _ in range(50)] == [
        rank(cands, costs, 2.0, b) for _ in range(50)
    ]


# -- ActiveSequences ------------------------------------------------------------------------

H = hash_blocks(list(range(16)), BS)  # 4 blocks


def test_active_counts_a_shared_prefix_once() -> None:
    """Two requests on one worker sharing 2 leading blocks: 6 distinct blocks plus one partial
    block each; pending prefill adds up."""
    act = ActiveSequences()
    other = hash_blocks([*range(8), 50, 51, 52, 53], BS)  # same first 2 blocks as H
    act.add("r1", 1, H, 16)
    act.add("r2", 1, other, 8)
    assert act.active_blocks(1) == len(set(H) | set(other)) + 2 == 7
    assert act.prefill_tokens(1) == 24
    assert act.requests(1) == 2 and len(act) == 2
    assert act.shared_prefix_blocks(1, H) == 4
    assert act.shared_prefix_blocks(1, hash_blocks([*range(8), 0, 0, 0, 0], BS)) == 2
    assert act.shared_prefix_blocks(2, H) == 0


def test_active_prefill_done_then_free_returns_to_zero() -> None:
    act = ActiveSequences()
    act.add("r1", 1, H, 16)
    act.add("r2", 2, H[:2], 8)
    act.prefill_done("r1")
    assert act.prefill_tokens(1) == 0 and act.active_blocks(1) == 5
    act.prefill_done("r1")  # twice: no change
    act.prefill_done("unknown")
    assert act.prefill_tokens(1) == 0 and act.prefill_tokens(2) == 8
    act.free("r1")
    act.free("r2")
    act.free("r2")  # twice: harmless
    for w in (1, 2):
        assert (act.prefill_tokens(w), act.active_blocks(w), act.requests(w)) == (0, 0, 0)
        assert act.shared_prefix_blocks(w, H) == 0
    assert len(act) == 0


def test_active_readding_a_request_replaces_it() -> None:
    act = ActiveSequences()
    act.add("r", 1, H, 16)
    act.add("r", 2, H[:1], 4)
    assert act.requests(1) == 0 and act.active_blocks(1) == 0 and act.prefill_tokens(1) == 0
    assert act.requests(2) == 1 and act.active_blocks(2) == 2 and act.prefill_tokens(2) == 4


@dataclass
class ActOp:
    kind: str  # add / first / free
    request: int
    worker: int
    blocks: int
    tokens: int


act_op_st = st.builds(
    ActOp,
    kind=st.sampled_from(["add", "add", "first", "free"]),
    request=st.integers(0, 5),
    worker=st.integers(0, 2),
    blocks=st.integers(0, 4),
    tokens=st.integers(0, 40),
)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(act_op_st, max_size=30))
def test_active_agrees_with_a_reference_and_drains_to_zero(ops: list[ActOp]) -> None:
    """Counts equal those recomputed from the live requests; freeing all leaves zeros."""
    act = ActiveSequences()
    live: dict[int, tuple[int, list[int], int]] = {}  # request -> worker, blocks, pending
    for op in ops:
        if op.kind == "add":
            act.add(op.request, op.worker, H[: op.blocks], op.tokens)
            live[op.request] = (op.worker, H[: op.blocks], op.tokens)
        elif op.kind == "first":
            act.prefill_done(op.request)
            if op.request in live:
                w, blocks, _ = live[op.request]
                live[op.request] = (w, blocks, 0)
        else:
            act.free(op.request)
            live.pop(op.request, None)
        for w in range(3):
            mine = [v for v in live.values() if v[0] == w]
            distinct = set().union(*(set(b) for _, b, _ in mine))
            assert act.prefill_tokens(w) == sum(p for _, _, p in mine)
            assert act.active_blocks(w) == len(distinct) + len(mine)
            assert act.requests(w) == len(mine)
    for r in list(live):
        act.free(r)
    assert len(act) == 0
    assert all(act.active_blocks(w) == act.prefill_tokens(w) == 0 for w in range(3))
