"""The scheduler with a KV tier, no model: a waiting prompt loads the blocks after its
prefix-cache hits that the tier holds (full blocks only, at least its last token left to
compute), counts them as cached once loaded, computes the rest; a failed tier load computes
them; a request that loads from a peer never asks the tier; evictions wait to be offloaded."""

from __future__ import annotations

import random

import pytest

from kvbaton.engine.block_manager import BlockManager
from kvbaton.engine.connector import KvLoad
from kvbaton.engine.scheduler import Scheduler
from kvbaton.engine.sequence import Sequence, SequenceStatus
from kvbaton.protocols.llm import KvTierStats, SamplingParams

pytestmark = pytest.mark.unit
BS = 4


class FakeTier:
    def __init__(self, hashes: list[int]) -> None:
        self.hashes = set(hashes)
        self.offloaded: list[tuple[int, int]] = []

    def lookup(self, block_hashes: list[int]) -> int:
        found = 0
        while found < len(block_hashes) and block_hashes[found] in self.hashes:
            found += 1
        return found

    def offload(self, blocks: list[tuple[int, int]]) -> None:
        self.offloaded += blocks

    def load(self, load: KvLoad) -> list[int]:
        return []

    def forget(self) -> None:
        pass

    def stats(self) -> KvTierStats:
        return KvTierStats()

    def close(self) -> None:
        pass


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=2))


def make(tier: FakeTier, num_blocks: int = 16) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, keep_evicted=True), 8, 64, True, 1024, tier)


def test_a_prompt_loads_what_the_tier_holds_then_computes_the_rest() -> None:
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks, 4 reusable
    hashes = seq("h", prompt).full_block_hashes(BS, 4)
    sched = make(FakeTier(hashes[:3]))
    s = seq("a", prompt)
    sched.add(s)
    assert sched.schedule().scheduled == []
    (load,) = sched.loads
    assert (load.first_block, load.block_hashes) == (0, hashes[:3])
    assert load.dst_blocks == s.block_table and s.status is SequenceStatus.LOADING
    sched.finish_load("a", True)
    assert (s.num_computed_tokens, s.num_cached_tokens) == (12, 12)
    assert set(hashes[:3]) <= set(sched.blocks.cached)  # now in the prefix cache
    out = sched.schedule()
    assert [(i.seq, i.num_tokens, i.samples) for i in out.scheduled] == [(s, 6, True)]


def test_a_failed_tier_load_computes_the_prompt() -> None:
    prompt = list(range(100, 118))
    sched = make(FakeTier(seq("h", prompt).full_block_hashes(BS, 4)))
    s = seq("a", prompt)
    sched.add(s)
    sched.schedule()
    sched.finish_load("a", False)
    assert (s.num_computed_tokens, s.num_cached_tokens) == (0, 0)
    assert sched.schedule().scheduled[0].num_tokens == len(prompt)


def test_the_last_token_is_always_computed() -> None:
    prompt = list(range(100, 116))  # 16 tokens: 4 full blocks, only 3 reusable
    hashes = seq("h", prompt).full_block_hashes(BS, 4)
    sched = make(FakeTier(hashes))
    sched.add(seq("a", prompt))
    sched.schedule()
    assert sched.loads[0].block_hashes == hashes[:3]


def test_a_request_loading_from_a_peer_never_asks_the_tier() -> None:
    prompt = list(range(100, 118))
    sched = make(FakeTier(seq("h", prompt).full_block_hashes(BS, 4)))
    s = seq("a", prompt)
    s.kv_source = FakeTier([])
    sched.add(s)
    sched.schedule()
    (load,) = sched.loads
    assert load.source is s.kv_source and load.block_hashes == []


def test_evicted_blocks_wait_to_be_offloaded() -> None:
    tier = FakeTier([])
    sched = make(tier, num_blocks=6)
    rng = random.Random(0)
    for i in range(3):  # each 5 blocks: the next one evicts it
        s = seq(f"r{i}", [rng.randrange(1000) for _ in range(18)])
        sched.add(s)
        while not s.is_finished:
            out = sched.schedule()
            sched.update(out, {x.seq.request_id: 7 for x in out.scheduled if x.samples})
    evicted = sched.blocks.take_evicted()
    assert evicted and all(sched.blocks.block_hash[b] != h for h, b in evicted)
    assert sched.blocks.take_evicted() == []
