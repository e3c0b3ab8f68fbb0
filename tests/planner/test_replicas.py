"""The replica arithmetic (`replicas.py`): the model's counts, bounds and budget, pacing
(step limit, scale-down patience), zero traffic and the queueing reaction.

The profile (as in test_perf_model.py) and targets give, per worker:
- prefill, TTFT 300 ms: 1000 tokens in 100 ms, 10,000 tok/s back to back, at 80% of that for
  the queueing (2 x (300 - 100) / (600 - 100)) -> 8,000 tok/s; 2000 in 200 ms, at 50% (2 x 100 /
  400) -> 5,000 tok/s;
- decode, ITL 20 ms: batch 8 at 20 ms -> 400 tok/s.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.planner.replicas import MAX_QUEUE_HOLDS, ReplicaPlanner, ReplicaPolicy, share_budget
from kvbaton.planner.types import Decision, Observation, Profile, ProfilePoint, Targets

pytestmark = pytest.mark.unit

PROFILE = Profile(
    engine="mocker",
    model="m",
    prefill=[ProfilePoint(1000, 100), ProfilePoint(2000, 200), ProfilePoint(4000, 500)],
    decode=[ProfilePoint(1, 10), ProfilePoint(8, 20), ProfilePoint(32, 50)],
)
TARGETS = Targets(ttft_ms=300, itl_ms=20)
QUIET = Observation(interval_s=10)


def planner(**policy: Any) -> ReplicaPlanner:
    return ReplicaPlanner(PROFILE, TARGETS, ReplicaPolicy(**policy))


FREE = {"max_prefill": 100, "max_decode": 100, "max_step": 100, "scale_down_patience": 1}


def decide(
    pl: ReplicaPlanner,
    rate: float,
    isl: float = 1000,
    osl: float = 100,
    hit: float = 0.0,
    current: tuple[int, int] = (1, 1),
    obs: Observation = QUIET,
) -> Decision:
    return pl.decide(
        predicted_rate=rate,
        predicted_isl=isl,
        predicted_osl=osl,
        prefix_hit_rate=hit,
        observation=obs,
        current_prefill=current[0],
        current_decode=current[1],
    )


def run(pl: ReplicaPlanner, rates: list[float], start: tuple[int, int], **kw: Any) -> list[int]:
    """Feeds the decisions back as the current counts; the prefill counts decided."""
    current, out = start, []
    for r in rates:
        d = decide(pl, r, current=current, **kw)
        current = (d.prefill, d.decode)
        out.append(d.prefill)
    return out


def test_hand_computed_counts() -> None:
    # prefill: 25 req/s x 2000 tokens = 50,000 tok/s / 5,000 -> 10
    # decode:  25 req/s x 100 tokens = 2,500 tok/s / 400 = 6.25 -> 7
    d = decide(planner(**FREE), rate=25, isl=2000, osl=100)
    assert (d.prefill, d.decode) == (10, 7)
    assert d.prefill_demand == pytest.approx(50_000)
    assert d.decode_demand == pytest.approx(2_500)
    assert d.prefill_capacity == pytest.approx(5_000)
    assert d.decode_capacity == pytest.approx(400)
    assert (d.predicted_request_rate, d.predicted_input_tokens) == (25, 2000)
    assert (d.predicted_output_tokens, d.current_prefill, d.current_decode) == (100, 1, 1)
    assert any("50000 tok/s over 5000 tok/s per worker -> 10" in r for r in d.reasons)
    assert any("2500 tok/s over 400 tok/s per worker -> 7" in r for r in d.reasons)


def test_prefix_hits_cut_the_prefill_demand() -> None:
    # 20 req/s x 2000 x (1 - 0.5) = 20,000 tok/s of 1000 uncached tokens each / 8,000 -> 3
    d = decide(planner(**FREE), rate=20, isl=2000, osl=20, hit=0.5)
    assert d.prefill_demand == pytest.approx(20_000)
    assert d.prefix_hit_rate == 0.5
    assert (d.prefill, d.decode) == (3, 1)  # decode: 400 tok/s / 400 -> 1


def test_an_exact_fit_does_not_round_up() -> None:
    d = decide(planner(**FREE), rate=8, isl=1000, osl=50)  # 8,000/8,000 and 400/400
    assert (d.prefill, d.decode) == (1, 1)
    # 0.1 + 0.2 req/s x 4000/3 tokens is 400.00000000000006 tok/s: still one decode worker
    d = decide(planner(**FREE), rate=0.1 + 0.2, isl=1000, osl=4000 / 3)
    assert d.decode == 1


def test_a_prompt_over_the_ttft_target_is_reported() -> None:
    d = decide(planner(**FREE), rate=1, isl=4000)  # 500 ms > 300 ms
    assert any("over the 300 ms TTFT target" in r for r in d.reasons)


def test_bounded_by_min_and_max() -> None:
    d = decide(planner(**{**FREE, "max_prefill": 4, "min_decode": 2}), rate=25, isl=2000, osl=1)
    assert (d.prefill, d.decode) == (4, 2)
    assert any("prefill: wanted 10 -> max 4" in r for r in d.reasons)
    assert any("decode: wanted 1 -> min 2" in r for r in d.reasons)


@pytest.mark.parametrize(
    ("want", "budget", "mins", "shared"),
    [
        ((5, 7), 12, (1, 1), (5, 7)),  # fits
        ((5, 7), 6, (1, 1), (3, 3)),  # 6 x 5/12 = 2.5 -> 3 (half up to prefill)
        ((2, 10), 6, (1, 1), (1, 5)),  # 6 x 2/12 = 1
        ((2, 10), 6, (2, 1), (2, 4)),  # raised to prefill's min
        ((10, 1), 6, (1, 2), (4, 2)),  # 6 x 10/11 = 5.45 -> 5, but decode's min is 2
    ],
)
def test_share_budget(
    want: tuple[int, int], budget: int, mins: tuple[int, int], shared: tuple[int, int]
) -> None:
    assert share_budget(*want, budget, *mins) == shared


def test_over_budget_the_budget_is_shared_in_proportion() -> None:
    d = decide(planner(**{**FREE, "max_total": 6}), rate=25, isl=2000, osl=100)
    assert (d.prefill, d.decode) == (4, 2)  # 6 x 10/17 = 3.5 -> 4
    assert any("budget 6 < wanted 10 + 7: shared as 4 + 2" in r for r in d.reasons)


def test_scale_up_is_immediate_but_at_most_max_step() -> None:
    pl = planner(max_prefill=100, max_decode=100, max_step=2)
    current = (1, 1)
    seen = []
    for _ in range(4):
        d = decide(pl, rate=20, isl=2000, osl=100, current=current)  # wants 8 and 5
        current = (d.prefill, d.decode)
        seen.append(current)
    assert seen == [(3, 3), (5, 5), (7, 5), (8, 5)]


def test_a_short_dip_does_not_scale_down() -> None:
    pl = planner(max_step=1, scale_down_patience=3)
    # 40 req/s x 1000 tokens -> 5 prefill; 8 req/s -> 1
    counts = run(pl, [40, 40, 8, 8, 40, 8, 8, 40], start=(5, 1), osl=1)
    assert counts == [5] * 8


def test_a_sustained_dip_scales_down_stepwise_after_the_patience() -> None:
    pl = planner(max_step=1, scale_down_patience=3)
    counts = run(pl, [40, 8, 8, 8, 8, 8, 8, 8, 8], start=(5, 1), osl=1)
    assert counts == [5, 5, 5, 4, 3, 2, 1, 1, 1]


def test_with_a_patience_of_one_a_scale_up_is_never_reversed_at_the_next_decision() -> None:
    pl = planner(max_step=10, scale_down_patience=1)
    # 40 req/s x 1000 tokens -> 5 prefill; 8 req/s -> 1: up; the dip right after it is held;
    # a dip that follows a decision without a scale-up scales down at once
    counts = run(pl, [40, 8, 40, 8, 8], start=(1, 1), osl=1)
    assert counts == [5, 5, 5, 1, 1]
    d = decide(pl, rate=40, current=(1, 1), osl=1)
    d = decide(pl, rate=8, current=(d.prefill, d.decode), osl=1)
    assert d.prefill == 5 and any("right after a scale-up" in r for r in d.reasons)


def test_with_a_patience_of_one_a_scale_down_follows_a_scale_down_at_once() -> None:
    pl = planner(max_step=1, scale_down_patience=1)
    counts = run(pl, [8, 8, 8, 8], start=(4, 1), osl=1)
    assert counts == [3, 2, 1, 1]


def test_a_scale_down_goes_to_the_highest_count_wanted_in_the_window() -> None:
    pl = planner(max_step=10, scale_down_patience=3)
    # wanted 4, 3, 2 below the current 6: down to 4, the highest of the three
    counts = run(pl, [32, 24, 16, 16, 16, 16], start=(6, 1), osl=1)
    assert counts == [6, 6, 4, 3, 2, 2]


def test_zero_traffic_goes_to_the_minimum_without_nan() -> None:
    pl = planner(min_prefill=1, min_decode=2, max_step=1, scale_down_patience=2)
    current = (4, 4)
    seen = []
    for _ in range(6):
        d = decide(pl, rate=0.0, isl=0.0, osl=0.0, current=current)
        current = (d.prefill, d.decode)
        seen.append(current)
        floats = [d.prefill_demand, d.decode_demand, d.prefill_capacity, d.decode_capacity]
        assert all(math.isfinite(v) and v >= 0 for v in floats)
    assert seen == [(4, 4), (3, 3), (2, 2), (1, 2), (1, 2), (1, 2)]


def test_non_finite_predictions_count_as_zero() -> None:
    d = decide(planner(**FREE), rate=math.nan, isl=math.inf, osl=-5, hit=math.nan, current=(3, 3))
    assert (d.prefill, d.decode) == (1, 1)
    assert (d.predicted_request_rate, d.predicted_output_tokens, d.prefix_hit_rate) == (0, 0, 0)
    assert d.predicted_input_tokens == 1e12  # +inf: clamped to the largest input
    assert any("predicted request rate nan is out of range: using 0" in r for r in d.reasons)


def queued(ttft_ms: float, queued_prefill: int, serving: int = 2) -> Observation:
    return Observation(
        interval_s=10, ttft_ms=ttft_ms, queued_prefill=queued_prefill, prefill_workers=serving
    )


def test_queueing_over_the_ttft_target_adds_a_prefill_worker() -> None:
    # The model wants 1 prefill worker (8,000 tok/s); 2 run; TTFT 500 ms > 300 with a queue.
    d = decide(planner(), rate=8, current=(2, 1), obs=queued(500, 3))
    assert d.prefill == 3
    assert any(r.startswith("queueing: measured TTFT 500 ms > target 300 ms") for r in d.reasons)


@pytest.mark.parametrize(
    ("obs", "policy"),
    [
        (queued(500, 0), {}),  # slow but nothing queued
        (queued(250, 3), {}),  # queued but within the target
        (queued(500, 3), {"queue_reaction": False}),
    ],
)
def test_no_queueing_reaction(obs: Observation, policy: dict[str, Any]) -> None:
    d = decide(planner(**policy), rate=8, current=(2, 1), obs=obs)
    assert d.prefill == 2  # held: the model wants 1, within the patience
    assert not any(r.startswith("queueing") for r in d.reasons)


def test_no_queueing_reaction_while_prefill_workers_asked_for_are_starting() -> None:
    # 2 asked for, 1 serves: the queue waits for the second rather than ask for a third...
    p = planner(scale_down_patience=10)  # (the model wants 1: no scale-down meanwhile)
    for _ in range(MAX_QUEUE_HOLDS):
        d = decide(p, rate=8, current=(2, 1), obs=queued(500, 3, serving=1))
        assert d.prefill == 2
        assert any("1 prefill worker(s) asked for are not serving yet" in r for r in d.reasons)
    # ... for a while: one that never comes up does not switch the reaction off.
    d = decide(p, rate=8, current=(2, 1), obs=queued(500, 3, serving=1))
    assert d.prefill == 3


def test_no_queueing_reaction_while_the_queue_drains_fast() -> None:
    # Each interval the queue at least halves: it is gone before a new worker would serve.
    p = planner(scale_down_patience=10)
    for backlog in (20, 10, 4):
        d = decide(p, rate=8, current=(2, 1), obs=queued(500, backlog))
        if backlog == 20:  # nothing to compare with yet: it reacts
            assert d.prefill == 3
            continue
        assert d.prefill == 2
        assert any("but the queue is draining" in r for r in d.reasons), d.reasons
    # Draining too slowly (4 -> 3): the reaction is back.
    d = decide(p, rate=8, current=(2, 1), obs=queued(500, 3))
    assert d.prefill == 3


def test_the_queueing_reaction_respects_the_maximum() -> None:
    d = decide(planner(max_prefill=2), rate=8, current=(2, 1), obs=queued(500, 3))
    assert d.prefill == 2


def test_a_scale_up_waits_for_budget_the_other_role_still_holds() -> None:
    pl = planner(max_total=10, max_step=3, scale_down_patience=2)
    # was 6 prefill + 4 decode; now 24 req/s x 1000 -> 3 prefill, 24 x 110 = 2640 -> 7 decode
    d = decide(pl, rate=24, osl=110, current=(6, 4))
    assert (d.prefill, d.decode) == (6, 4)  # prefill waits out its patience; decode waits too
    assert any("held back by the budget of 10" in r for r in d.reasons)
    d = decide(pl, rate=24, osl=110, current=(6, 4))
    assert (d.prefill, d.decode) == (3, 7)


def test_counts_outside_the_bounds_are_brought_in_at_once() -> None:
    pl = planner(max_prefill=8, max_decode=8, max_total=10, max_step=1)
    d = decide(pl, rate=100, isl=2000, osl=1000, current=(12, 9))
    assert d.prefill <= 8 and d.decode <= 8 and d.prefill + d.decode <= 10


def test_bad_policies_are_rejected() -> None:
    for bad in (
        {"min_prefill": 3, "max_prefill": 2},
        {"min_decode": -1},
        {"max_total": 1},
        {"max_step": 0},
        {"scale_down_patience": 0},
        {"queue_step": 0},
    ):
        with pytest.raises(ValueError):
            ReplicaPolicy(**bad)


policies = st.builds(
    lambda min_p, extra_p, min_d, extra_d, total, step, patience: ReplicaPolicy(
        min_prefill=min_p,
        max_prefill=min_p + extra_p,
        min_decode=min_d,
        max_decode=min_d + extra_d,
        max_total=None if total is None else min_p + min_d + total,
        max_step=step,
        scale_down_patience=patience,
    ),
    st.integers(0, 4),
    st.integers(0, 12),
    st.integers(0, 4),
    st.integers(0, 12),
    st.none() | st.integers(0, 16),
    st.integers(1, 4),
    st.integers(1, 4),
)
anything = st.floats(allow_nan=True, allow_infinity=True)
intervals = st.tuples(
    anything | st.floats(0, 200),  # rate
    anything | st.floats(0, 8000),  # isl
    anything | st.floats(0, 2000),  # osl
    anything | st.floats(0, 1),  # hit rate
    st.floats(0, 1000),  # measured ttft
    st.integers(0, 5),  # queued
)


@settings(max_examples=200, deadline=None)
@given(
    policy=policies,
    steps=st.lists(intervals, min_size=1, max_size=12),
    start=st.tuples(st.integers(0, 30), st.integers(0, 30)),
)
def test_decisions_stay_within_bounds_and_budget_and_finite(
    policy: ReplicaPolicy,
    steps: list[tuple[float, float, float, float, float, int]],
    start: tuple[int, int],
) -> None:
    pl = ReplicaPlanner(PROFILE, TARGETS, policy)
    current = start
    for rate, isl, osl, hit, ttft, n_queued in steps:
        d = decide(pl, rate, isl, osl, hit, current=current, obs=queued(ttft, n_queued))
        assert policy.min_prefill <= d.prefill <= policy.max_prefill
        assert policy.min_decode <= d.decode <= policy.max_decode
        assert d.prefill + d.decode <= policy.budget
        floats = [
            d.predicted_request_rate,
            d.predicted_input_tokens,
            d.predicted_output_tokens,
            d.prefill_demand,
            d.decode_demand,
            d.prefill_capacity,
            d.decode_capacity,
            d.prefix_hit_rate,
        ]
        assert all(math.isfinite(v) and v >= 0 for v in floats), d
        assert d.reasons
        in_bounds = (
            policy.min_prefill <= current[0] <= policy.max_prefill
            and policy.min_decode <= current[1] <= policy.max_decode
            and sum(current) <= policy.budget
        )
        if in_bounds:  # then pacing holds: at most max_step per role per interval
            assert abs(d.prefill - current[0]) <= policy.max_step
            assert abs(d.decode - current[1]) <= policy.max_step
        current = (d.prefill, d.decode)
