"""How many prefill and decode workers the next interval needs: the planner's arithmetic.

Each interval, `ReplicaPlanner.decide` goes through these steps, in order:
1. wanted (the model): prefill demand = rate * isl * (1 - prefix hit rate) prompt tokens/s,
   over `prefill_capacity` at the uncached prompt length isl * (1 - hit) (one request's prefill
   costs t(uncached tokens)); decode demand = rate * osl output tokens/s, over
   `decode_capacity`; each count is the ceiling of demand / capacity (0 with no demand);
2. queueing reaction: measured TTFT over the target with requests queued at the prefill workers
   asks for at least current prefill + `queue_step`, whatever the model says, unless
   - the queue at least halved since the last look: at that pace it is empty within the next
     interval, before a worker asked for now could serve (the TTFT measured is the backlog's,
     of a step already met);
   - or a prefill worker asked for does not serve yet (the observation counts those that
     answer): the queue is theirs to drain, and asking for more would overshoot; this waits
     `MAX_QUEUE_HOLDS` intervals at most (a worker that never comes up, or is too loaded to
     answer);
3. bounds: each count clamped to [min, max] of its role; if the two exceed the total budget,
   the budget is shared in proportion to the wanted counts, each at least its min;
4. pacing, per role: scale up at once by at most `max_step`; scale down only after the wanted
   count has stayed below the current one for `scale_down_patience` consecutive intervals, and
   never at the decision right after a scale-up of the role (that would reverse it on one
   interval: flapping; with a patience of 2 or more this holds anyway), then by at most
   `max_step` per interval, to the highest count wanted within that window (as Kubernetes' HPA
   stabilisation window does);
5. hard limits: the result is always within [min, max] and the budget, even when the current
   counts are not (then bounds win over pacing); a scale-up that would break the budget while
   the other role waits out its patience is held back first.

Invariants: counts are ints within their bounds and their sum within the budget; every float in
a `Decision` is finite and >= 0 (non-finite or negative predictions count as 0, predictions
above `MAX_INPUT` as `MAX_INPUT`); every step that shaped the counts is in `reasons`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from kvbaton.planner.perf_model import (
    decode_batch_at_target,
    decode_capacity,
    prefill_capacity,
    prefill_meets_ttft,
    prefill_ms,
    validate_profile,
    validate_targets,
)
from kvbaton.planner.types import Decision, Observation, Profile, Targets

# Predictions are clamped to MAX_INPUT: no deployment nears it, and every product stays finite.
MAX_INPUT = 1e12
_MAX_WANTED = 10**9  # the model's count before bounds, at most (keeps ceil() finite)
MAX_QUEUE_HOLDS = 3  # intervals the queueing reaction waits for starting workers, at most
_EPS = 1e-9  # so that demand/capacity = 3.0000000001, a rounding error, still wants 3


@dataclass(frozen=True)
class ReplicaPolicy:
    """The planner's settings. `max_total` None: no budget beyond the per-role maxima."""

    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    max_total: int | None = None  # prefill + decode, at most
    max_step: int = 2  # workers added or removed per role per interval, at most
    scale_down_patience: int = 3  # intervals the wanted count must stay below the current one
    queue_reaction: bool = True  # TTFT over target with a queue -> prefill + queue_step
    queue_step: int = 1

    def __post_init__(self) -> None:
        for role, lo, hi in (
            ("prefill", self.min_prefill, self.max_prefill),
            ("decode", self.min_decode, self.max_decode),
        ):
            if not 0 <= lo <= hi:
                raise ValueError(f"{role}: need 0 <= min <= max (got min {lo}, max {hi})")
        if self.max_total is not None and self.max_total < self.min_prefill + self.min_decode:
            raise ValueError(
                f"max_total {self.max_total} is below min_prefill + min_decode "
                f"({self.min_prefill} + {self.min_decode})"
            )
        if self.max_step < 1:
            raise ValueError(f"max_step must be >= 1 (got {self.max_step})")
        if self.scale_down_patience < 1:
            raise ValueError(
                f"scale_down_patience must be >= 1 (1: at once; got {self.scale_down_patience})"
            )
        if self.queue_step < 1:
            raise ValueError(f"queue_step must be >= 1 (got {self.queue_step})")

    @property
    def budget(self) -> int:
        cap = self.max_prefill + self.max_decode
        return cap if self.max_total is None else min(cap, self.max_total)


def _clean(name: str, value: float, reasons: list[str], hi: float = MAX_INPUT) -> float:
    """`value` if finite and within [0, hi]; else 0 (NaN, negative, -inf) or hi (too large)."""
    if math.isfinite(value) and 0.0 <= value <= hi:
        return float(value)
    fixed = hi if value > hi else 0.0  # NaN compares False: 0
    reasons.append(f"{name} {value!r} is out of range: using {fixed:g}")
    return fixed


def _wanted(demand: float, capacity: float, ceiling: int) -> int:
    """ceil(demand / capacity), 0 with no demand; `ceiling` caps it (and an unusable capacity)."""
    if demand <= 0.0:
        return 0
    if capacity <= 0.0:
        return ceiling
    ratio = demand / capacity
    return ceiling if ratio >= ceiling else math.ceil(ratio - _EPS)


def share_budget(
    want_prefill: int, want_decode: int, budget: int, min_prefill: int, min_decode: int
) -> tuple[int, int]:
    """Counts within `budget`: the wanted ones if they fit, else the budget shared in proportion
    to them (round half up to prefill), each raised to its min (budget >= the two mins)."""
    total = want_prefill + want_decode
    if total <= budget:
        return want_prefill, want_decode
    prefill = math.floor(budget * want_prefill / total + 0.5)
    prefill = max(min_prefill, min(prefill, budget - min_decode))
    return prefill, budget - prefill


class _Pacer:
    """One role's pacing: the wanted counts of the last `patience` intervals."""

    def __init__(self, role: str, patience: int) -> None:
        self.role = role
        self.patience = patience
        self.window: deque[int] = deque(maxlen=patience)
        self.scaled_up = False  # by the last decision (set by the planner, after hard limits)

    def step(self, current: int, wanted: int, max_step: int, reasons: list[str]) -> int:
        self.window.append(wanted)
        if wanted > current:
            new = min(wanted, current + max_step)
            reasons.append(f"{self.role}: scale up {current} -> {new} (wanted {wanted})")
            return new
        if wanted == current:
            return current
        if self.scaled_up:
            reasons.append(
                f"{self.role}: wanted {wanted} < current {current} right after a scale-up: "
                f"holding at {current}"
            )
            return current
        streak = 0  # consecutive intervals, up to this one, that wanted fewer than `current`
        for w in reversed(self.window):
            if w >= current:
                break
            streak += 1
        if streak < self.patience:
            reasons.append(
                f"{self.role}: wanted {wanted} < current {current} for {streak} of "
                f"{self.patience} intervals of patience: holding at {current}"
            )
            return current
        new = max(max(self.window), current - max_step)
        reasons.append(
            f"{self.role}: scale down {current} -> {new} (wanted {wanted}; below {current} "
            f"for the last {self.patience} interval(s))"
        )
        return new


def _trim(
    counts: dict[str, int], floors: dict[str, int], budget: int, why: str, reasons: list[str]
) -> None:
    """Lowers `counts` (never below `floors`), the role with the most room first, until their
    sum fits `budget` or every count is at its floor."""
    over = sum(counts.values()) - budget
    for role in sorted(counts, key=lambda r: floors[r] - counts[r]):
        if over <= 0:
            return
        cut = min(over, max(0, counts[role] - floors[role]))
        if cut:
            reasons.append(f"{role}: {counts[role]} -> {counts[role] - cut} ({why})")
            counts[role] -= cut
            over -= cut


class ReplicaPlanner:
    """Decides the prefill and decode counts interval by interval; keeps only the pacing state
    (the recent wanted counts per role). Profile and targets are validated once, here."""

    def __init__(
        self, profile: Profile, targets: Targets, policy: ReplicaPolicy | None = None
    ) -> None:
        validate_profile(profile)
        validate_targets(targets)
        self.profile = profile
        self.targets = targets
        self.policy = policy or ReplicaPolicy()
        patience = self.policy.scale_down_patience
        self._pacers = {r: _Pacer(r, patience) for r in ("prefill", "decode")}
        self._queue_holds = 0  # consecutive intervals the queueing reaction waited
        self._last_queued: int | None = None  # queued_prefill at the last decision

    def decide(
        self,
        predicted_rate: float,
        predicted_isl: float,
        predicted_osl: float,
        prefix_hit_rate: float,
        observation: Observation,
        current_prefill: int,
        current_decode: int,
    ) -> Decision:
        """The next interval's counts (see the module's docstring for the steps)."""
        pol, tg = self.policy, self.targets
        reasons: list[str] = []
        rate = _clean("predicted request rate", predicted_rate, reasons)
        isl = _clean("predicted input tokens", predicted_isl, reasons)
        osl = _clean("predicted output tokens", predicted_osl, reasons)
        hit = _clean("prefix hit rate", prefix_hit_rate, reasons, hi=1.0)
        current = {"prefill": max(0, current_prefill), "decode": max(0, current_decode)}
        bounds = {
            "prefill": (pol.min_prefill, pol.max_prefill),
            "decode": (pol.min_decode, pol.max_decode),
        }

        # 1. The model.
        uncached = isl * (1.0 - hit)
        p_demand, d_demand = rate * uncached, rate * osl
        p_cap = prefill_capacity(self.profile, tg, uncached)
        d_cap = decode_capacity(self.profile, tg)
        want = {
            "prefill": _wanted(p_demand, p_cap, _MAX_WANTED),
            "decode": _wanted(d_demand, d_cap, _MAX_WANTED),
        }
        reasons.append(
            f"prefill: {rate:g} req/s x {uncached:g} uncached tokens = {p_demand:g} tok/s over "
            f"{p_cap:g} tok/s per worker -> {want['prefill']}"
        )
        reasons.append(
            f"decode: {rate:g} req/s x {osl:g} output tokens = {d_demand:g} tok/s over "
            f"{d_cap:g} tok/s per worker -> {want['decode']}"
        )
        if uncached > 0 and not prefill_meets_ttft(self.profile, tg, uncached):
            t = prefill_ms(self.profile, uncached)
            reasons.append(
                f"prefill of {uncached:g} tokens takes {t:g} ms, over the {tg.ttft_ms:g} ms TTFT "
                f"target: no worker count meets it"
            )
        if decode_batch_at_target(self.profile, tg) is None:
            reasons.append(
                f"decode ITL at the smallest batch is over the {tg.itl_ms:g} ms target: "
                f"planned at batch 1"
            )

        # 2. The queueing reaction.
        obs = observation
        queued = obs.queued_prefill
        last_queued, self._last_queued = self._last_queued, queued
        if current["prefill"] <= obs.prefill_workers:
            self._queue_holds = 0
        if pol.queue_reaction and obs.ttft_ms > tg.ttft_ms and queued > 0:
            queueing = (
                f"queueing: measured TTFT {obs.ttft_ms:g} ms > target {tg.ttft_ms:g} ms with "
                f"{queued} queued"
            )
            starting = current["prefill"] - obs.prefill_workers
            if last_queued is not None and 2 * queued <= last_queued:
                reasons.append(
                    f"{queueing}, but the queue is draining ({last_queued} -> {queued} over the "
                    f"interval): no more"
                )
            elif starting > 0 and self._queue_holds < MAX_QUEUE_HOLDS:  # theirs to drain first
                self._queue_holds += 1
                reasons.append(
                    f"{queueing}, but {starting} prefill worker(s) asked for are not serving "
                    f"yet: no more until they are (held {self._queue_holds} of at most "
                    f"{MAX_QUEUE_HOLDS} intervals)"
                )
            else:
                floor = current["prefill"] + pol.queue_step
                want["prefill"] = max(want["prefill"], floor)
                reasons.append(f"{queueing}: prefill wanted at least {floor}")

        # 3. Bounds and budget.
        for role, (lo, hi) in bounds.items():
            bounded = min(max(want[role], lo), hi)
            if bounded != want[role]:
                side = "max" if want[role] > hi else "min"
                reasons.append(f"{role}: wanted {want[role]} -> {side} {bounded}")
                want[role] = bounded
        budget = pol.budget
        p, d = share_budget(
            want["prefill"], want["decode"], budget, pol.min_prefill, pol.min_decode
        )
        if (p, d) != (want["prefill"], want["decode"]):
            reasons.append(
                f"budget {budget} < wanted {want['prefill']} + {want['decode']}: "
                f"shared as {p} + {d}"
            )
        want = {"prefill": p, "decode": d}

        # 4. Pacing.
        new = {r: self._pacers[r].step(current[r], want[r], pol.max_step, reasons) for r in want}

        # 5. Hard limits: bounds, then the budget (undo scale-ups first, then pacing).
        for role, (lo, hi) in bounds.items():
            if not lo <= new[role] <= hi:
                fixed = min(max(new[role], lo), hi)
                reasons.append(f"{role}: {new[role]} is outside [{lo}, {hi}]: {fixed}")
                new[role] = fixed
        no_scale_up = {
            r: max(current[r], bounds[r][0]) if new[r] > current[r] else new[r] for r in new
        }
        _trim(new, no_scale_up, budget, f"scale-up held back by the budget of {budget}", reasons)
        _trim(new, want, budget, f"the budget of {budget} overrides pacing", reasons)
        for role in new:
            if new[role] == current[role] == want[role]:
                reasons.append(f"{role}: unchanged at {current[role]}")
            self._pacers[role].scaled_up = new[role] > current[role]

        return Decision(
            prefill=new["prefill"],
            decode=new["decode"],
            predicted_request_rate=rate,
            predicted_input_tokens=isl,
            predicted_output_tokens=osl,
            prefill_demand=p_demand,
            decode_demand=d_demand,
            prefill_capacity=p_cap,
            decode_capacity=d_cap,
            reasons=reasons,
            prefix_hit_rate=hit,
            current_prefill=current["prefill"],
            current_decode=current["decode"],
        )
