"""The load predictors (`predictors.py`): constant, moving average, Holt, level shift; the
registry."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbaton.planner.predictors import (
    PREDICTORS,
    ConstantPredictor,
    HoltPredictor,
    LevelShiftPredictor,
    MovingAveragePredictor,
    Predictor,
    make_predictor,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", sorted(PREDICTORS))
def test_no_observation_predicts_zero(name: str) -> None:
    p = make_predictor(name, interval_s=5.0)
    assert isinstance(p, Predictor)
    assert p.predict() == 0.0


def test_constant_predicts_the_last_value() -> None:
    p = ConstantPredictor()
    for v in (3.0, 7.5, 2.0):
        p.observe(v)
    assert p.predict() == 2.0


def test_moving_average_over_its_window() -> None:
    p = MovingAveragePredictor(window=3)
    p.observe(3.0)
    assert p.predict() == 3.0  # fewer than `window` values: the mean of those seen
    p.observe(6.0)
    assert p.predict() == pytest.approx(4.5)
    for v in (9.0, 12.0):
        p.observe(v)
    assert p.predict() == pytest.approx((6.0 + 9.0 + 12.0) / 3)  # 3.0 left the window


def test_holt_follows_a_ramp_with_small_error() -> None:
    p = HoltPredictor(alpha=0.5, beta=0.3)
    errors = []
    for t in range(30):
        value = 10.0 + 5.0 * t
        if t >= 2:
            errors.append(abs(p.predict() - value))
        p.observe(value)
    assert max(errors) < 1e-9  # exact on a linear ramp once initialised from two points
    assert p.predict() == pytest.approx(10.0 + 5.0 * 30)


def test_holt_follows_a_noisy_ramp_better_than_the_moving_average() -> None:
    holt, avg = HoltPredictor(), MovingAveragePredictor(window=5)
    holt_err = avg_err = 0.0
    for t in range(60):
        value = 100.0 + 4.0 * t + (3.0 if t % 2 else -3.0)
        if t >= 10:
            holt_err += abs(holt.predict() - value)
            avg_err += abs(avg.predict() - value)
        holt.observe(value)
        avg.observe(value)
    assert holt_err / 50 < 8.0  # within ~2 intervals' growth, noise included
    assert holt_err < avg_err / 2


def test_holt_never_predicts_negative_on_a_falling_ramp() -> None:
    p = HoltPredictor(alpha=0.9, beta=0.9)
    for v in (100.0, 60.0, 20.0, 0.0, 0.0):
        p.observe(v)
        assert p.predict() >= 0.0
    assert p.predict() == 0.0


def poisson_rates(rate: float, interval_s: float, n: int, rng: random.Random) -> list[float]:
    """`n` intervals' measured rates (arrivals / interval_s) of a Poisson process at `rate`."""
    out = []
    for _ in range(n):
        t, count = rng.expovariate(rate), 0
        while t < interval_s:
            count, t = count + 1, t + rng.expovariate(rate)
        out.append(count / interval_s)
    return out


def test_level_shift_averages_poisson_noise_that_the_constant_predictor_follows() -> None:
    rng = random.Random(1)
    shift, const = LevelShiftPredictor(interval_s=5.0), ConstantPredictor()
    shift_err = const_err = 0.0
    for i, value in enumerate(poisson_rates(1.0, 5.0, 200, rng)):
        if i >= 5:
            shift_err += abs(shift.predict() - 1.0)
            const_err += abs(const.predict() - 1.0)
        shift.observe(value)
        const.observe(value)
    # Constant: off by ~0.37/s an interval on average; level shift ~0.19/s (a false shift, in
    # 1.4% of the intervals, restarts its mean from one value).
    assert shift_err < 0.6 * const_err


def test_level_shift_follows_a_step_up_and_down_at_once() -> None:
    p = LevelShiftPredictor(interval_s=5.0, threshold=2.5)
    for v in (1.0, 0.8, 1.2, 1.0):
        p.observe(v)
    assert p.predict() == pytest.approx(1.0)
    p.observe(2.0)  # within 2.5 x sqrt(1/5) = 1.12/s of the level: noise, averaged in
    assert p.predict() == pytest.approx(1.2)
    p.observe(4.0)  # past it: a new level, from this value alone
    assert p.predict() == 4.0
    p.observe(3.4)
    assert p.predict() == pytest.approx(3.7)
    p.observe(1.0)  # 2.7 below 3.7, and 2.5 x sqrt(3.7/5) = 2.15
    assert p.predict() == 1.0


def test_level_shift_follows_a_step_that_arrives_as_a_ramp() -> None:
    # The arrivals of bench/planner.py's trace, a step from 1 to 4/s, per 5 s interval.
    p = LevelShiftPredictor(interval_s=5.0)
    for v in (1.0, 0.6, 1.2, 0.8, 1.0):
        p.observe(v)
    seen = []
    for v in (2.2, 3.0, 4.0, 4.4):
        p.observe(v)
        seen.append(p.predict())
    # 2.2 is a shift (2.7 deviations); 3.0 and 4.0 are more than one deviation further up while
    # the level is young: it is still shifting. 4.4 (0.5 deviation) is averaged in.
    assert seen == pytest.approx([2.2, 3.0, 4.0, 4.2])


def test_level_shift_averages_noise_back_towards_an_old_level() -> None:
    p = LevelShiftPredictor(interval_s=5.0)
    for v in (1.0, 1.0, 1.0, 1.0, 2.2):  # up: a young level at 2.2
        p.observe(v)
    p.observe(1.6)  # down, against the shift, by 0.9 deviations: noise, averaged
    assert p.predict() == pytest.approx(1.9)


def test_level_shift_averages_at_most_its_window() -> None:
    p = LevelShiftPredictor(interval_s=100.0, threshold=1e9, window=2)
    for v in (10.0, 20.0, 30.0):
        p.observe(v)
    assert p.predict() == pytest.approx(25.0)


def test_level_shift_from_zero_traffic_starts_at_the_first_arrival() -> None:
    p = LevelShiftPredictor(interval_s=5.0)
    for v in (0.0, 0.0, 0.2):
        p.observe(v)
    assert p.predict() == pytest.approx(0.2)  # a level of 0 has no noise: any arrival shifts it


@pytest.mark.parametrize("name", sorted(PREDICTORS))
def test_non_finite_observations_are_ignored(name: str) -> None:
    p = make_predictor(name, interval_s=5.0)
    p.observe(4.0)
    before = p.predict()
    for bad in (math.nan, math.inf, -math.inf):
        p.observe(bad)
    assert p.predict() == before


@given(
    name=st.sampled_from(sorted(PREDICTORS)),
    values=st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=40),
)
def test_predictions_are_always_finite_and_non_negative(name: str, values: list[float]) -> None:
    p = make_predictor(name, interval_s=5.0)
    for v in values:
        p.observe(v)
        out = p.predict()
        assert math.isfinite(out) and out >= 0.0


def test_registry_names_and_options() -> None:
    assert set(PREDICTORS) == {"constant", "moving-average", "holt", "level-shift"}
    p = make_predictor("moving-average", window=2)
    assert isinstance(p, MovingAveragePredictor) and p.window == 2
    h = make_predictor("holt", alpha=0.2, beta=0.1)
    assert isinstance(h, HoltPredictor) and (h.alpha, h.beta) == (0.2, 0.1)
    s = make_predictor("level-shift", interval_s=10, threshold=3, window=4)
    assert isinstance(s, LevelShiftPredictor)
    assert (s.interval_s, s.threshold) == (10.0, 3.0)
    assert make_predictor("constant", interval_s=10).predict() == 0.0  # ignored where not needed
    with pytest.raises(ValueError, match="needs the planner's interval_s"):
        make_predictor("level-shift")


def test_unknown_name_is_rejected_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown predictor 'arima'.*constant, holt"):
        make_predictor("arima")


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("constant", {"window": 3}),
        ("moving-average", {"window": 0}),
        ("moving-average", {"window": 2.5}),
        ("holt", {"alpha": 0.0}),
        ("holt", {"beta": 1.5}),
        ("holt", {"gamma": 0.1}),
        ("level-shift", {"interval_s": 0.0}),
        ("level-shift", {"interval_s": math.inf}),
        ("level-shift", {"interval_s": 5.0, "threshold": 0.0}),
        ("level-shift", {"interval_s": 5.0, "window": 0}),
        ("level-shift", {"interval_s": 5.0, "alpha": 0.5}),
    ],
)
def test_bad_options_are_rejected(name: str, options: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        make_predictor(name, **options)
