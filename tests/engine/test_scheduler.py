"""The scheduler and block manager together, with no model: a fake step samples tokens."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.engine.block_manager import BlockManager
from kvbaton.engine.scheduler import Scheduler, SchedulerOutput
from kvbaton.engine.sequence import Sequence
from kvbaton.protocols.llm import SamplingParams

pytestmark = pytest.mark.unit


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    max_seqs: int = 8,
    budget: int = 32,
    chunked: bool = True,
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_seqs, budget, chunked, 1024)


def step(sched: Scheduler, rng: random.Random, vocab: int = 50) -> SchedulerOutput:
    out = sched.schedule()
    sampled = {s.seq.request_id: rng.randrange(vocab) for s in out.scheduled if s.samples}
    sched.update(out, sampled)
    return out


def test_chunked_prefill_then_decode() -> None:
    sched = make(budget=8)
    s = Sequence("a", list(range(20)), SamplingParams(max_tokens=3))
    sched.add(s)
    rng = random.Random(0)
    chunks = [step(sched, rng).scheduled[0].num_tokens for _ in range(5)]
    assert chunks == [8, 8, 4, 1, 1]  # the 4 completes the prompt and samples the first token
    assert s.is_finished and s.num_output_tokens == 3 and s.finish_reason == "length"


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    sched = make(budget=16, chunked=False)
    a = Sequence("a", list(range(10)), SamplingParams(max_tokens=5))
    b = Sequence("b", list(range(50, 60)), SamplingParams(max_tokens=5))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(x.seq.request_id, x.num_tokens) for x in out.scheduled] == [("a", 10)]


def test_stop_token_respects_min_tokens() -> None:
    sched = make()
    s = Sequence(
        "a", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=2), stop_token_ids=frozenset({7})
    )
    sched.add(s)
    for token in (7, 7, 7):  # the first two come before min_tokens is met (a sampler masks them)
        out = sched.schedule()
        sched.update(out, {"a": token})
    assert s.finish_reason == "stop" and s.output_token_ids == [7, 7, 7]


def test_preemption_recomputes_and_frees() -> None:
    sched = make(num_blocks=6, block_size=4, budget=64)
    seqs = [
        Sequence(f"s{i}", list(range(i, i + 7)), SamplingParams(max_tokens=12)) for i in range(3)
    ]
    for s in seqs:
        sched.add(s)
    rng = random.Random(1)
    preempted = 0
    while sched.has_unfinished():
        preempted += len(step(sched, rng).preempted)
    assert preempted > 0
    assert all(s.num_output_tokens == 12 for s in seqs)
    assert sched.blocks.num_free_blocks == 6


def test_a_preempted_sequence_longer_than_the_budget_still_runs_without_chunking() -> None:
    """Without chunked prefill a prompt must fit the budget, but a preempted sequence comes back
    with its output too, which may not: its recompute is chunked, or it would wait forever."""
    for trial in range(300):
        rng = random.Random(trial)
        num_blocks, budget = rng.randrange(4, 12), rng.randrange(8, 20)
        sched = Scheduler(BlockManager(num_blocks, 4, rng.random() < 0.5), 8, budget, False, 1024)
        for i in range(3):
            n = rng.randrange(1, min(budget, num_blocks * 4 - 1) + 1)
            sched.add(
                Sequence(
                    f"s{i}",
                    [rng.randrange(30) for _ in range(n)],
                    SamplingParams(max_tokens=rng.randrange(1, num_blocks * 4 - n + 1)),
                )
            )
        for _ in range(500):
            out = step(sched, rng, vocab=30)
            assert out.scheduled or not sched.has_unfinished(), f"stuck in trial {trial}"
            if not sched.has_unfinished():
                break
        assert not sched.has_unfinished()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(8, 64),
    chunked=st.booleans(),
    prefix_caching=st.booleans(),
)
def test_blocks_always_return_to_the_pool(
    seed: int, num_blocks: int, block_size: int, budget: int, chunked: bool, prefix_caching: bool
) -> None:
    """Random workloads with shared prefixes, aborts and preemption: after every request ends,
    is aborted or preempted, the free-block count returns to where it started, and while they
    run every block's reference count equals the number of block tables holding it."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    sched = Scheduler(bm, 6, budget, chunked, 10_000)
    prefixes = [[rng.randrange(20) for _ in range(rng.randrange(0, 12))] for _ in range(3)]
    capacity = num_blocks * block_size
    requests = []
    for i in range(25):
        prompt = rng.choice(prefixes) + [rng.randrange(20) for _ in range(rng.randrange(1, 10))]
        max_tokens = rng.randrange(1, 12)
        if len(prompt) + max_tokens > capacity or (not chunked and len(prompt) > budget):
            continue  # the engine refuses these at admission
        requests.append(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens)))
    pending = list(requests)
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        if rng.random() < 0.05 and requests:
            sched.abort(rng.choice(requests).request_id)
        step(sched, rng)
        holders: dict[int, int] = {}
        for s in sched.running:
            for b in s.block_table:
                holders[b] = holders.get(b, 0) + 1
        assert all(bm.ref_counts[b] == holders.get(b, 0) for b in range(num_blocks))
        assert set(bm.free) == {b for b in range(num_blocks) if bm.ref_counts[b] == 0}
        if not pending and not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == num_blocks
    for s in requests:
        assert s.is_finished
        assert s.finish_reason == "abort" or s.num_output_tokens == s.params.max_tokens


def test_aborting_a_held_sequence_frees_its_blocks_and_slot_once() -> None:
    """A held sequence's output may never be read (its request was cancelled first): its abort
    frees what it holds; a late `release` then frees nothing."""
    sched = make(max_seqs=1)
    free = sched.blocks.num_free_blocks
    held = Sequence("h", list(range(10)), SamplingParams(max_tokens=5), hold_kv=True)
    sched.add(held)
    step(sched, random.Random(0))
    assert list(sched.held) == ["h"] and sched.num_active == 1
    assert sched.abort("h") is held and held.finish_reason == "abort"
    assert (sched.num_active, sched.blocks.num_free_blocks) == (0, free)
    assert sched.abort("h") is None and not sched.release("h")
    assert sched.blocks.num_free_blocks == free
    after = Sequence("next", list(range(5)), SamplingParams(max_tokens=1))
    sched.add(after)
    assert [s.seq for s in step(sched, random.Random(0)).scheduled] == [after]  # the slot's back
