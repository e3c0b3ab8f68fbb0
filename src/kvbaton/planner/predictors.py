"""Load predictors: each interval the planner feeds one number (a request rate, a mean prompt or
output length) and asks for the next interval's value.

Invariants, for every predictor here:
- `predict()` before any observation is 0.0;
- `predict()` is always a finite float >= 0 (the quantities forecast are rates and lengths);
- a non-finite observation (NaN, +-inf) is ignored: one bad metric must not poison the state
  for the rest of the run.

Four predictors, by name in `PREDICTORS`:
- "constant": the last value seen;
- "moving-average": the mean of the last `window` values;
- "holt": Holt's double exponential smoothing (level + trend), one interval ahead, so a ramp is
  followed rather than lagged;
- "level-shift": the mean of the values since the level last shifted, so that the noise of
  Poisson arrivals is averaged out while a step is followed at once.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

_MAX = sys.float_info.max


def _output(value: float) -> float:
    """A prediction made safe: finite and >= 0 (NaN -> 0, +inf -> the largest float)."""
    if math.isnan(value) or value <= 0.0:
        return 0.0
    return min(value, _MAX)


@runtime_checkable
class Predictor(Protocol):
    """Forecasts a non-negative quantity one interval ahead."""

    def observe(self, value: float) -> None:
        """Record the value measured over the interval that just ended."""

    def predict(self) -> float:
        """The value expected over the next interval: finite, >= 0; 0.0 with no observation."""


class ConstantPredictor:
    """Predicts the last value observed."""

    def __init__(self) -> None:
        self._last = 0.0

    def observe(self, value: float) -> None:
        if math.isfinite(value):
            self._last = value

    def predict(self) -> float:
        return _output(self._last)


class MovingAveragePredictor:
    """Predicts the mean of the last `window` values observed (fewer until `window` are in)."""

    def __init__(self, window: int = 5) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"moving-average window must be an integer >= 1 (got {window!r})")
        self.window = window
        self._values: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        if math.isfinite(value):
            self._values.append(value)

    def predict(self) -> float:
        if not self._values:
            return 0.0
        n = len(self._values)
        # Divided before summing, so that a window of huge values cannot overflow to inf.
        return _output(sum(v / n for v in self._values))


class HoltPredictor:
    """Holt's linear (double exponential) smoothing, forecasting one interval ahead.

    level_t = alpha * y_t + (1 - alpha) * (level_{t-1} + trend_{t-1})
    trend_t = beta * (level_t - level_{t-1}) + (1 - beta) * trend_{t-1}
    forecast = max(0, level_t + trend_t)

    Initialised from the first two observations (level = y_1, then trend = y_2 - y_1, level =
    y_2), so that a linear ramp is forecast exactly from the second observation on. If the state
    ever overflows (absurd inputs), it restarts from the latest observation.
    """

    def __init__(self, alpha: float = 0.5, beta: float = 0.3) -> None:
        for name, v in (("alpha", alpha), ("beta", beta)):
            if not (isinstance(v, int | float) and 0.0 < v <= 1.0):
                raise ValueError(f"holt {name} must be in (0, 1] (got {v!r})")
        self.alpha = float(alpha)
        self.beta = float(beta)
        self._level = 0.0
        self._trend = 0.0
        self._seen = 0

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        if self._seen == 0:
            level, trend = value, 0.0
        elif self._seen == 1:
            level, trend = value, value - self._level
        else:
            level = self.alpha * value + (1.0 - self.alpha) * (self._level + self._trend)
            trend = self.beta * (level - self._level) + (1.0 - self.beta) * self._trend
        if not (math.isfinite(level) and math.isfinite(trend)):
            level, trend = value, 0.0
        self._level, self._trend = level, trend
        self._seen = min(self._seen + 1, 2)

    def predict(self) -> float:
        if self._seen == 0:
            return 0.0
        return _output(self._level + self._trend)


class LevelShiftPredictor:
    """The mean of the values seen since the level last shifted (the last `window` of them at
    most). A value more than `threshold` standard deviations away from that mean is a shift:
    the level restarts from it alone. So is, while the level is young (fewer than `YOUNG`
    values), a value more than one deviation further in the direction of the shift that
    started it: the shift is still under way (a step seen through Poisson arrivals looks like
    a ramp over the first intervals, as 2.2, 3.0, 4.0/s after a step from 1 to 4/s), and
    averaging it would lag.

    The deviation is that of a Poisson count over one interval, expressed per second:
    sqrt(mean / interval_s). Arrivals are Poisson, so a rate measured over 5 s at 1 request/s
    wanders by +-0.45/s by chance alone; `threshold` 2.5 takes a jump past 2.1/s for a shift
    (1.4% of intervals at a steady 1/s: 11 arrivals or more where 5 are expected), while a
    step to 4/s is past it in its first whole interval. The same measure is applied to mean
    lengths (tokens per request), where it is a floor rather than a model: a shift of a few
    percent restarts the level."""

    YOUNG = 3

    def __init__(self, interval_s: float, threshold: float = 2.5, window: int = 12) -> None:
        if not (isinstance(interval_s, int | float) and 0.0 < interval_s < math.inf):
            raise ValueError(f"level-shift interval_s must be > 0 (got {interval_s!r})")
        if not (isinstance(threshold, int | float) and 0.0 < threshold < math.inf):
            raise ValueError(f"level-shift threshold must be > 0 (got {threshold!r})")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"level-shift window must be an integer >= 1 (got {window!r})")
        self.interval_s = float(interval_s)
        self.threshold = float(threshold)
        self._values: deque[float] = deque(maxlen=window)
        self._direction = 0.0  # the sign of the last shift (0: none yet)

    def _mean(self) -> float:
        n = len(self._values)
        return sum(v / n for v in self._values)

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        if self._values:
            mean = self._mean()
            deviation = math.sqrt(max(mean, 0.0) / self.interval_s)
            off = value - mean
            under_way = (
                len(self._values) < self.YOUNG
                and off * self._direction > 0
                and abs(off) > deviation
            )
            if abs(off) > self.threshold * deviation or under_way:
                self._values.clear()
                self._direction = math.copysign(1.0, off)
        self._values.append(value)

    def predict(self) -> float:
        return _output(self._mean()) if self._values else 0.0


PREDICTORS: dict[str, Callable[..., Predictor]] = {
    "constant": ConstantPredictor,
    "moving-average": MovingAveragePredictor,
    "holt": HoltPredictor,
    "level-shift": LevelShiftPredictor,
}


def make_predictor(name: str, *, interval_s: float | None = None, **options: Any) -> Predictor:
    """The predictor registered as `name`, built with `options` (e.g. window=5, alpha=0.5).
    `interval_s`: the planner's interval, given to the predictors that need it (level-shift).

    Raises ValueError for an unknown name, an unknown option or a bad option value."""
    try:
        factory = PREDICTORS[name]
    except KeyError:
        known = ", ".join(sorted(PREDICTORS))
        raise ValueError(f"unknown predictor {name!r} (known: {known})") from None
    if factory is LevelShiftPredictor:
        if interval_s is None:
            raise ValueError("predictor 'level-shift' needs the planner's interval_s")
        options = {"interval_s": interval_s, **options}
    try:
        return factory(**options)
    except TypeError as e:
        raise ValueError(f"bad options for predictor {name!r}: {options!r} ({e})") from e
