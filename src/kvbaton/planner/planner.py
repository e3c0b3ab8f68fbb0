"""The planner's loop: every adjustment interval, observe, predict the next interval's load,
decide the replicas of each pool, and have the connector apply them.

Invariants:
- One decision per interval, logged with every input it was made from, exported as metrics
  (`kvbaton_planner_*`) and published for the frontends' cluster page (`reports.py`).
- An interval whose observation fails changes nothing (the next one covers both).
- A connector that fails to apply a decision is logged and tried again at the next interval,
  never retried in a tight loop.
- With `dry_run` nothing is ever changed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvbaton.planner.connectors import Connector
from kvbaton.planner.observer import ObserveError, Observer
from kvbaton.planner.predictors import Predictor
from kvbaton.planner.replicas import ReplicaPlanner
from kvbaton.planner.reports import DecisionReports
from kvbaton.planner.types import Decision, Observation

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


@dataclass
class Predictors:
    """One predictor per observed series."""

    request_rate: Predictor
    input_tokens: Predictor
    output_tokens: Predictor

    def observe(self, observation: Observation) -> None:
        self.request_rate.observe(observation.request_rate)
        if observation.request_rate > 0:  # lengths are only known from requests
            self.input_tokens.observe(observation.avg_input_tokens)
            self.output_tokens.observe(observation.avg_output_tokens)


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.replicas = Gauge(
            "kvbaton_planner_replicas", "Replicas decided per role", ["role"], registry=registry
        )
        self.current = Gauge(
            "kvbaton_planner_current_replicas",
            "Replicas the connector reported before the decision",
            ["role"],
            registry=registry,
        )
        self.predicted = Gauge(
            "kvbaton_planner_predicted",
            "Predicted next-interval load: request_rate (1/s), input_tokens, output_tokens",
            ["series"],
            registry=registry,
        )
        self.demand = Gauge(
            "kvbaton_planner_demand_tokens_per_second",
            "Predicted demand per role",
            ["role"],
            registry=registry,
        )
        self.capacity = Gauge(
            "kvbaton_planner_capacity_tokens_per_second",
            "What one worker of a role sustains at its latency target",
            ["role"],
            registry=registry,
        )
        self.observed = Gauge(
            "kvbaton_planner_observed",
            "The last interval: request_rate, ttft_ms, itl_ms, prefix_hit_rate, queued_prefill",
            ["series"],
            registry=registry,
        )
        self.decisions = Counter(
            "kvbaton_planner_decisions", "Decisions made", ["applied"], registry=registry
        )

    def record(
        self, observation: Observation, decision: Decision, current: dict[str, int], applied: bool
    ) -> None:
        for role in ROLES:
            self.current.labels(role).set(current.get(role, 0))
        self.replicas.labels("prefill").set(decision.prefill)
        self.replicas.labels("decode").set(decision.decode)
        self.predicted.labels("request_rate").set(decision.predicted_request_rate)
        self.predicted.labels("input_tokens").set(decision.predicted_input_tokens)
        self.predicted.labels("output_tokens").set(decision.predicted_output_tokens)
        self.demand.labels("prefill").set(decision.prefill_demand)
        self.demand.labels("decode").set(decision.decode_demand)
        self.capacity.labels("prefill").set(decision.prefill_capacity)
        self.capacity.labels("decode").set(decision.decode_capacity)
        for series in ("request_rate", "ttft_ms", "itl_ms", "prefix_hit_rate", "queued_prefill"):
            self.observed.labels(series).set(getattr(observation, series))
        self.decisions.labels(str(applied).lower()).inc()


class Planner:
    def __init__(
        self,
        observer: Observer,
        connector: Connector,
        replicas: ReplicaPlanner,
        predictors: Predictors,
        *,
        interval_s: float,
        dry_run: bool = False,
        metrics: PlannerMetrics | None = None,
        on_decision: Callable[[Observation, Decision], None] | None = None,
        reports: DecisionReports | None = None,
    ) -> None:
        """`reports`: each decision published for the frontends' cluster page."""
        self.observer = observer
        self.connector = connector
        self.replicas = replicas
        self.predictors = predictors
        self.interval_s = interval_s
        self.dry_run = dry_run
        self.metrics = metrics
        self.on_decision = on_decision
        self.reports = reports
        self._stop = asyncio.Event()

    async def step(self) -> Decision | None:
        """One interval's observation, decision and (unless dry-run) scaling."""
        try:
            observation = await self.observer.observe()
        except ObserveError as exc:
            log.warning("planner: no observation this interval: %s", exc)
            return None
        self.predictors.observe(observation)
        current = await self.connector.current()
        decision = self.replicas.decide(
            predicted_rate=self.predictors.request_rate.predict(),
            predicted_isl=self.predictors.input_tokens.predict(),
            predicted_osl=self.predictors.output_tokens.predict(),
            prefix_hit_rate=observation.prefix_hit_rate,
            observation=observation,
            current_prefill=current.get("prefill", 0),
            current_decode=current.get("decode", 0),
        )
        log.info(
            "planner decision: prefill %d -> %d, decode %d -> %d%s | observed %s | decided %s",
            current.get("prefill", 0),
            decision.prefill,
            current.get("decode", 0),
            decision.decode,
            " (dry run)" if self.dry_run else "",
            observation,
            decision,
        )
        applied = False
        if not self.dry_run:
            try:
                for role, wanted in (("prefill", decision.prefill), ("decode", decision.decode)):
                    if current.get(role) != wanted:
                        await self.connector.scale(role, wanted)
                applied = True
            except Exception as exc:  # tried again at the next interval
                log.error("planner: could not apply the decision: %s", exc)
        if self.metrics is not None:
            self.metrics.record(observation, decision, current, applied)
        if self.on_decision is not None:
            self.on_decision(observation, decision)
        if self.reports is not None:
            await self.reports.publish(decision, current, applied, self.dry_run)
        return decision

    async def run(self) -> None:
        """Every `interval_s`, one step, until `stop()`."""
        await self.observer.start()
        next_at = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_at - time.monotonic())):
                    await self._stop.wait()
            if self._stop.is_set():
                break
            next_at += self.interval_s
            await self.step()

    def stop(self) -> None:
        self._stop.set()
