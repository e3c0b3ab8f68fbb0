"""The per-worker capacity model (`perf_model.py`) on a hand-made profile.

prefill: 1000 tokens -> 100 ms, 2000 -> 200 ms, 4000 -> 500 ms (last slope 0.15 ms/token)
decode:  batch 1 -> 10 ms, 8 -> 20 ms, 32 -> 50 ms
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbaton.planner.perf_model import (
    decode_batch_at_target,
    decode_capacity,
    decode_itl_ms,
    prefill_capacity,
    prefill_meets_ttft,
    prefill_ms,
    validate_profile,
)
from kvbaton.planner.types import Profile, ProfilePoint, Targets

pytestmark = pytest.mark.unit


def profile(
    prefill: list[tuple[float, float]] | None = None,
    decode: list[tuple[float, float]] | None = None,
) -> Profile:
    prefill = prefill if prefill is not None else [(1000, 100), (2000, 200), (4000, 500)]
    decode = decode if decode is not None else [(1, 10), (8, 20), (32, 50)]
    return Profile(
        engine="mocker",
        model="m",
        prefill=[ProfilePoint(x, ms) for x, ms in prefill],
        decode=[ProfilePoint(x, ms) for x, ms in decode],
        decode_context=1024,
    )


P = profile()
T = Targets(ttft_ms=300, itl_ms=20)


@pytest.mark.parametrize(
    ("tokens", "ms"),
    [
        (1000, 100),  # on a point
        (1500, 150),  # interpolated
        (3000, 350),
        (500, 100),  # below the first point: the first point's time
        (0, 100),
        (5000, 650),  # extrapolated along the last segment: 500 + 0.15 * 1000
    ],
)
def test_prefill_time_interpolates(tokens: float, ms: float) -> None:
    assert prefill_ms(P, tokens) == pytest.approx(ms)


def test_prefill_capacity_leaves_room_for_the_queue_the_ttft_target_allows() -> None:
    # 1000 tokens per 100 ms back to back; TTFT 300 ms leaves a mean wait of 200 ms, which an
    # M/D/1 queue reaches at rho = 2 x 200 / (600 - 100) = 0.8.
    assert prefill_capacity(P, T, 1000) == pytest.approx(0.8 * 10_000)
    assert prefill_capacity(P, T, 500) == pytest.approx(0.8 * 5000)  # 500 tokens per 100 ms
    assert prefill_capacity(P, T, 2000) == pytest.approx(0.5 * 10_000)  # 200 ms: rho 200/400
    assert prefill_capacity(P, T, 0) == 0.0
    # At that load the mean TTFT is the target: t + rho t / (2 (1 - rho)).
    rho, t = 0.8, 100
    assert t + rho * t / (2 * (1 - rho)) == pytest.approx(T.ttft_ms)


def test_prefill_over_the_ttft_target_still_has_the_capacity_of_running() -> None:
    assert not prefill_meets_ttft(P, T, 4000)  # 500 ms > 300 ms
    assert prefill_meets_ttft(P, T, 2000)
    assert prefill_capacity(P, T, 4000) == pytest.approx(4000 * 1000 / 500)  # back to back
    assert prefill_capacity(P, T, 3000) == pytest.approx(3000 * 1000 / 350)


def test_a_falling_last_segment_never_extrapolates_faster() -> None:
    p = profile(prefill=[(1000, 100), (2000, 90)])
    assert prefill_ms(p, 10_000) == pytest.approx(90)


@pytest.mark.parametrize(
    ("itl_target", "batch", "capacity"),
    [
        (20, 8, 8 * 1000 / 20),  # exactly on a point
        (35, 20, 20 * 1000 / 35),  # 8 + 24 * (35 - 20) / (50 - 20): interpolated
        (15, 4.5, 4.5 * 1000 / 15),  # 1 + 7 * (15 - 10) / (20 - 10)
        (60, 32, 32 * 1000 / 50),  # the whole curve meets it: the largest batch, no further
    ],
)
def test_decode_capacity_at_the_largest_batch_meeting_the_itl(
    itl_target: float, batch: float, capacity: float
) -> None:
    t = Targets(ttft_ms=300, itl_ms=itl_target)
    assert decode_batch_at_target(P, t) == pytest.approx(batch)
    assert decode_capacity(P, t) == pytest.approx(capacity)


def test_decode_missing_the_target_even_at_batch_one() -> None:
    t = Targets(ttft_ms=300, itl_ms=5)
    assert decode_batch_at_target(P, t) is None
    assert decode_capacity(P, t) == pytest.approx(1000 / 10)
    # A curve starting above batch 1 uses its first point's ITL for batch 1.
    p = profile(decode=[(4, 12), (16, 30)])
    assert decode_capacity(p, t) == pytest.approx(1000 / 12)
    assert decode_itl_ms(p, 1) == 12


def test_decode_takes_the_largest_batch_on_a_non_monotone_curve() -> None:
    p = profile(decode=[(1, 10), (4, 30), (8, 18), (16, 40)])
    t = Targets(ttft_ms=300, itl_ms=20)
    # 8 -> 18 ms meets it; 16 -> 40 does not: crossing at 8 + 8 * (20 - 18) / (40 - 18)
    assert decode_batch_at_target(p, t) == pytest.approx(8 + 8 * 2 / 22)


def test_the_batch_found_meets_the_target_despite_rounding_on_a_steep_segment() -> None:
    # Found by hypothesis: interpolating back from the crossing gave an ITL 1.2e-9 over.
    p = profile(decode=[(65062, 0.5), (65065, 1906.0)])
    b = decode_batch_at_target(p, Targets(ttft_ms=300, itl_ms=1.0))
    assert b is not None and b == pytest.approx(65062.000787)
    assert decode_itl_ms(p, b) <= 1.0


@pytest.mark.parametrize(
    ("prefill", "decode", "match"),
    [
        ([(1000, 100)], None, r"profile\.prefill: needs at least 2 points \(got 1\)"),
        ([], None, r"profile\.prefill: needs at least 2 points"),
        ([(1000, 100), (1000, 120)], None, r"profile\.prefill\[1\]: x must be strictly ascending"),
        ([(2000, 100), (1000, 120)], None, r"strictly ascending"),
        ([(1000, 100), (2000, 0)], None, r"profile\.prefill\[1\]: ms must be positive"),
        ([(1000, -1), (2000, 5)], None, r"ms must be positive"),
        ([(1000, math.nan), (2000, 5)], None, r"ms must be positive and finite"),
        ([(0, 1), (2000, 5)], None, r"profile\.prefill\[0\]: x must be finite and > 0"),
        (None, [(0.5, 1), (2, 5)], r"profile\.decode\[0\]: x must be finite and >= 1"),
        (None, [(1, 10)], r"profile\.decode: needs at least 2 points"),
        (None, [(1, 10), (math.inf, 20)], r"profile\.decode\[1\]: x must be finite"),
    ],
)
def test_bad_profiles_are_rejected_clearly(
    prefill: list[tuple[float, float]] | None,
    decode: list[tuple[float, float]] | None,
    match: str,
) -> None:
    bad = profile(prefill, decode)
    with pytest.raises(ValueError, match=match):
        validate_profile(bad)
    with pytest.raises(ValueError, match=match):
        prefill_capacity(bad, T, 1000)
    with pytest.raises(ValueError, match=match):
        decode_capacity(bad, T)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_targets_are_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match=r"targets\.ttft_ms"):
        prefill_capacity(P, Targets(ttft_ms=bad, itl_ms=20), 1000)
    with pytest.raises(ValueError, match=r"targets\.itl_ms"):
        decode_capacity(P, Targets(ttft_ms=300, itl_ms=bad))


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_token_counts_are_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="input_tokens"):
        prefill_capacity(P, T, bad)


def test_the_profile_round_trips_through_json() -> None:
    assert Profile.from_json(P.to_json()) == P


curves = st.lists(
    st.tuples(
        st.integers(min_value=1, max_value=100_000), st.floats(min_value=0.01, max_value=1e5)
    ),
    min_size=2,
    max_size=8,
    unique_by=lambda p: p[0],
).map(sorted)


@given(
    prefill=curves,
    decode=curves,
    tokens=st.floats(min_value=0, max_value=1e7),
    ttft=st.floats(min_value=0.01, max_value=1e6),
    itl=st.floats(min_value=0.01, max_value=1e4),
)
def test_capacities_are_finite_and_positive(
    prefill: list[tuple[float, float]],
    decode: list[tuple[float, float]],
    tokens: float,
    ttft: float,
    itl: float,
) -> None:
    p, t = profile(prefill, decode), Targets(ttft_ms=ttft, itl_ms=itl)
    cap = prefill_capacity(p, t, tokens)
    assert math.isfinite(cap) and cap >= 0
    if tokens == 0:
        assert cap == 0
    d = decode_capacity(p, t)
    assert math.isfinite(d) and d > 0
    b = decode_batch_at_target(p, t)
    if b is not None:
        assert decode[0][0] <= b <= decode[-1][0]
        assert decode_itl_ms(p, b) <= itl * (1 + 1e-9)
