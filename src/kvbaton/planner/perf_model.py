"""What one worker sustains at the SLA, read off its measured `Profile`. Pure functions.

The model (deliberately simple; the planner's queueing reaction corrects what it misses):

Prefill. One request of n prompt tokens takes t(n) ms, linearly interpolated on the profile's
prefill curve. A prefill worker runs requests back to back, one at a time: n * 1000 / t(n)
prompt tokens/s at full utilisation, where, arrivals being random, its queue grows without
bound. At the TTFT target T it sustains the load at which the mean TTFT, t plus the mean wait
of an M/D/1 queue (Poisson arrivals, a fixed service time t: rho * t / (2 * (1 - rho))), is T:
    rho = 2 * (T - t) / (2 * T - t),   capacity(n) = rho * n * 1000 / t(n)   prompt tokens/s
(rho = 8/9 at T = 5 t). Workers behind one router wait less than one such queue each, so this
errs toward one worker more. Planning at full utilisation instead, bench/planner.py lost 14
points of goodput to queues at its step up. If t(n) >= T, no number of workers meets the
target for such requests; the capacity is then that of running at all (rho = 1) and
`prefill_meets_ttft` says so.
Below the first profiled point t is the first point's time (a conservative floor: the profile
says nothing of smaller prompts, where a fixed cost per request dominates); beyond the last
point t is extrapolated linearly along the last segment (slope floored at 0: a longer prompt
never prefills faster).

Decode. At a batch of b concurrent sequences each step takes itl(b) ms (interpolated on the
decode curve) and yields b tokens, so a worker sustains b * 1000 / itl(b) output tokens/s. The
planner uses the largest batch b (interpolated between points) with itl(b) <= the ITL target. No
extrapolation beyond the largest profiled batch: it is the largest the worker was seen to hold
(KV memory bounds it). If even the smallest batch misses the target, the worker runs one
sequence at a time: capacity = 1000 / itl(1) (itl(1) is the first point's ITL when the curve
starts above batch 1). The curve was measured at `profile.decode_context` tokens of context;
contexts of other lengths are not corrected for.

Profiles are validated on every call (`validate_profile`): at least 2 points per curve, x
strictly ascending, ms positive and finite, prefill x > 0 and decode batches >= 1.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from kvbaton.planner.types import Profile, ProfilePoint, Targets


def _validate_curve(name: str, points: Sequence[ProfilePoint], min_x: float, strict: bool) -> None:
    if len(points) < 2:
        raise ValueError(f"profile.{name}: needs at least 2 points (got {len(points)})")
    prev: float | None = None
    for i, p in enumerate(points):
        if not math.isfinite(p.x) or p.x < min_x or (strict and p.x == min_x):
            bound = f"> {min_x:g}" if strict else f">= {min_x:g}"
            raise ValueError(f"profile.{name}[{i}]: x must be finite and {bound} (got {p.x!r})")
        if not (math.isfinite(p.ms) and p.ms > 0):
            raise ValueError(f"profile.{name}[{i}]: ms must be positive and finite (got {p.ms!r})")
        if prev is not None and p.x <= prev:
            raise ValueError(
                f"profile.{name}[{i}]: x must be strictly ascending ({p.x!r} after {prev!r})"
            )
        prev = p.x


def validate_profile(profile: Profile) -> None:
    """Raises ValueError, naming the curve and point, unless both curves are usable."""
    _validate_curve("prefill", profile.prefill, 0.0, strict=True)
    _validate_curve("decode", profile.decode, 1.0, strict=False)


def validate_targets(targets: Targets) -> None:
    """Raises ValueError unless both targets are positive and finite."""
    for name, v in (("ttft_ms", targets.ttft_ms), ("itl_ms", targets.itl_ms)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"targets.{name} must be positive and finite (got {v!r})")


def _interpolate(points: Sequence[ProfilePoint], x: float, extrapolate: bool) -> float:
    """ms at x: linear between points; the first point's ms below the first point; beyond the
    last, the last segment extended (slope floored at 0) if `extrapolate`, else the last ms."""
    first, last = points[0], points[-1]
    if x <= first.x:
        return first.ms
    if x >= last.x:
        if not extrapolate:
            return last.ms
        prev = points[-2]
        slope = max(0.0, (last.ms - prev.ms) / (last.x - prev.x))
        return last.ms + slope * (x - last.x)
    for a, b in itertools.pairwise(points):
        if x <= b.x:
            return a.ms + (b.ms - a.ms) * (x - a.x) / (b.x - a.x)
    raise AssertionError("unreachable: x lies within the curve")  # pragma: no cover


def _check_tokens(input_tokens: float) -> None:
    if not (math.isfinite(input_tokens) and input_tokens >= 0):
        raise ValueError(f"input_tokens must be finite and >= 0 (got {input_tokens!r})")


def prefill_ms(profile: Profile, input_tokens: float) -> float:
    """t(n): the prefill time of one request of `input_tokens` prompt tokens, in ms (> 0)."""
    validate_profile(profile)
    _check_tokens(input_tokens)
    return _interpolate(profile.prefill, input_tokens, extrapolate=True)


def prefill_meets_ttft(profile: Profile, targets: Targets, input_tokens: float) -> bool:
    """Whether one request of `input_tokens` prefills within the TTFT target on an idle worker."""
    validate_targets(targets)
    return prefill_ms(profile, input_tokens) <= targets.ttft_ms


def prefill_capacity(profile: Profile, targets: Targets, input_tokens: float) -> float:
    """Prompt tokens/s one prefill worker sustains on requests of `input_tokens` tokens at the
    TTFT target: rho * n * 1000 / t(n) (see the module's docstring). 0.0 for n = 0."""
    validate_targets(targets)
    t = prefill_ms(profile, input_tokens)
    capacity = input_tokens * 1000.0 / t
    target = targets.ttft_ms
    if t < target:  # else no count meets the target: the capacity of running at all
        capacity *= 2 * (target - t) / (2 * target - t)
    if not math.isfinite(capacity):
        raise ValueError(f"prefill capacity overflows at {input_tokens!r} tokens")
    return capacity


def decode_itl_ms(profile: Profile, batch: float) -> float:
    """itl(b): the inter-token latency at a batch of `batch` sequences, in ms (> 0); the first
    point's ITL below the first point, the last point's beyond the last (no extrapolation)."""
    validate_profile(profile)
    if not (math.isfinite(batch) and batch >= 0):
        raise ValueError(f"batch must be finite and >= 0 (got {batch!r})")
    return _interpolate(profile.decode, batch, extrapolate=False)


def decode_batch_at_target(profile: Profile, targets: Targets) -> float | None:
    """The largest batch b within the profile with itl(b) <= the ITL target (interpolated, so
    fractional), or None if the whole profiled curve lies above the target."""
    validate_profile(profile)
    validate_targets(targets)
    target, pts = targets.itl_ms, profile.decode
    if pts[-1].ms <= target:
        return pts[-1].x
    # Walk down from the top: the first segment whose lower end meets the target crosses it.
    for i in range(len(pts) - 2, -1, -1):
        a, b = pts[i], pts[i + 1]  # b.ms > target here
        if a.ms <= target:
            x = a.x + (b.x - a.x) * (target - a.ms) / (b.ms - a.ms)
            # Rounding can put itl(x) a hair over the target on a steep segment: step x down.
            for _ in range(64):
                if x <= a.x or _interpolate(pts, x, extrapolate=False) <= target:
                    return max(x, a.x)
                x = math.nextafter(x, a.x)
            return a.x
    return None


def decode_capacity(profile: Profile, targets: Targets) -> float:
    """Output tokens/s one decode worker sustains at ITL <= target: b * 1000 / itl(b) at the
    largest such batch b; 1000 / itl(1) if even the smallest batch misses the target."""
    b = decode_batch_at_target(profile, targets)
    if b is None:
        return 1000.0 / decode_itl_ms(profile, 1.0)
    return b * 1000.0 / decode_itl_ms(profile, b)
