"""Tier-aware routing: the index follows host and disk tier events (a disk store shared by the
workers that name it), credits each leading block by the best tier a worker has it in, and the
KV router prefers a worker that can load a prefix to one that must compute it, and one that
has it in its pool to both."""

from __future__ import annotations

import pytest

from kvbaton.llm.hashing import hash_blocks
from kvbaton.protocols.kv import DISK, HOST, BlockRemoved, BlockStored, KvDump
from kvbaton.router.cost import Candidate, kv_cost
from kvbaton.router.indexer import KvIndexer, TierCredits
from kvbaton.router.kv_router import KvRouter
from kvbaton.router.policies import RouteRequest

pytestmark = pytest.mark.unit

BS = 4
A, B, C = 0xA, 0xB, 0xC
TOKENS = list(range(100, 133))  # 33 tokens: 8 full blocks, all reusable
H = hash_blocks(TOKENS, BS)
CREDITS = TierCredits()
STORE = "host-1:/var/kv/0123"


def stored(hashes: list[int], tier: str = "device", store: str | None = None) -> BlockStored:
    return BlockStored(
        event_id=0,
        block_hashes=hashes,
        parent_hash=None,
        token_ids=[] if tier != "device" else [0] * BS * len(hashes),
        block_size=BS,
        tier=tier,
        store=store,
    )


def test_the_walk_credits_each_block_by_its_best_tier() -> None:
    index = KvIndexer()
    index.apply(A, stored(H[:2]))  # the pool keeps the head
    index.apply(A, stored(H[2:5], HOST))  # host memory the next blocks
    index.apply(A, stored(H[5:7], DISK, STORE))  # disk the next ones
    assert index.has_tiers
    credited = index.credited_overlaps(H, [A, B], CREDITS)
    assert credited == {A: 2 + 3 * 0.75 + 2 * 0.25}
    index.apply(A, BlockRemoved(event_id=1, block_hashes=[H[3]], tier=HOST))
    assert index.credited_overlaps(H, [A], CREDITS) == {A: 2 + 0.75}  # the walk ends at H[3]


def test_a_disk_store_counts_for_every_worker_that_names_it() -> None:
    index = KvIndexer()
    index.apply(A, stored(H, DISK, STORE))
    index.load_dump(B, KvDump(last_event_id=-1, block_hashes=[], store=STORE, store_block_hashes=H))
    index.apply(C, stored(H[:1], DISK, "host-2:/var/kv/0123"))  # another host
    assert index.credited_overlaps(H, [A, B, C], CREDITS) == {A: 2.0, B: 2.0, C: 0.25}
    index.apply(B, BlockRemoved(event_id=0, block_hashes=H[4:], tier=DISK, store=STORE))
    assert index.credited_overlaps(H, [A], CREDITS) == {A: 1.0}  # removed for all
    index.remove_worker(A)
    assert index.credited_overlaps(H, [B], CREDITS) == {B: 1.0}  # B still names it
    index.remove_worker(B)
    index.remove_worker(C)
    assert not index.has_tiers


def test_a_dump_replaces_the_tiers_of_its_worker() -> None:
    index = KvIndexer()
    index.apply(A, stored(H[:4], HOST))
    dump = KvDump(last_event_id=3, block_hashes=H[:1], host_block_hashes=H[1:2])
    index.load_dump(A, dump)
    assert index.credited_overlaps(H, [A], CREDITS) == {A: 1.75}
    assert index.find_matches(H) == {A: 1}


def test_events_of_an_unknown_tier_are_ignored() -> None:
    index = KvIndexer()
    index.apply(A, stored(H, "tape"))
    assert not index.has_tiers and index.credited_overlaps(H, [A], CREDITS) == {}


def test_credits_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="disk <= host"):
        TierCredits(host=0.2, disk=0.5)


def test_loadable_blocks_lower_the_cost() -> None:
    base = Candidate(A, 2, 0, 0, 0, 0)
    loads = Candidate(A, 2, 0, 0, 0, 0, tier_blocks=3 * 0.75)
    assert kv_cost(loads, len(TOKENS), BS, 8.0) == kv_cost(base, len(TOKENS), BS, 8.0) - 8 * 2.25


def test_the_router_prefers_pool_then_tier_then_nothing() -> None:
    index = KvIndexer()
    router = KvRouter(index, BS, model="m")
    request = RouteRequest(token_ids=TOKENS, extra_keys=None)
    index.apply(B, stored(H, HOST))  # B can load the whole prefix from memory
    assert router.route(request, [A, B]).ranking == [B, A]
    index.apply(C, stored(H))  # C has it in its pool
    assert router.route(request, [A, B, C]).ranking == [C, B, A]
    disk_only = KvRouter(KvIndexer(), BS, model="m", tier_credits=TierCredits(0.75, 0.0))
    disk_only.indexer.apply(B, stored(H, DISK, STORE))
    assert disk_only.route(request, [A, B]).ranking == [A, B]  # disk credit 0: a tie, by order


def test_the_credits_flag() -> None:
    from kvbaton.cli.routing import ROUTER_FLAGS, parse_tier_credits

    assert parse_tier_credits("0.5,0.1") == TierCredits(0.5, 0.1)
    for bad in ("0.5", "a,b", "0.1,0.5"):
        with pytest.raises(ValueError):
            parse_tier_credits(bad)
    assert "kv_tier_credits" in ROUTER_FLAGS  # serve passes it on to its frontend
