"""The planner's loop with scripted observations: what it decides, logs, exports and applies;
and the observer's arithmetic on the frontend's metrics."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from kvbaton.planner.connectors import DryRunConnector
from kvbaton.planner.observer import FrontendTotals, ObserveError, interval, parse_totals
from kvbaton.planner.planner import Planner, PlannerMetrics, Predictors
from kvbaton.planner.predictors import make_predictor
from kvbaton.planner.replicas import ReplicaPlanner, ReplicaPolicy
from kvbaton.planner.types import Observation, Profile, ProfilePoint, Targets
from kvbaton.protocols.llm import WorkerLoad

pytestmark = pytest.mark.unit

PROFILE = Profile(
    engine="mocker",
    model="m",
    prefill=[ProfilePoint(100, 10.0), ProfilePoint(1000, 100.0)],  # 10k tokens/s a worker
    decode=[ProfilePoint(1, 5.0), ProfilePoint(10, 10.0)],  # 1000 tokens/s at ITL 10 ms
)


class ScriptedObserver:
    def __init__(self, observations: list[Observation | None]) -> None:
        self.observations = observations

    async def start(self) -> None: ...

    async def observe(self) -> Observation:
        observation = self.observations.pop(0)
        if observation is None:
            raise ObserveError("frontend unreachable")
        return observation


class FailingConnector(DryRunConnector):
    async def scale(self, role: str, replicas: int) -> None:
        raise RuntimeError("API server down")


def load(rate: float, isl: float = 500, osl: float = 100, **kw: float) -> Observation:
    return Observation(
        interval_s=10,
        request_rate=rate,
        avg_input_tokens=isl,
        avg_output_tokens=osl,
        **kw,  # type: ignore[arg-type]
    )


def make_planner(
    observations: list[Observation | None],
    connector: DryRunConnector,
    dry_run: bool = False,
) -> tuple[Planner, CollectorRegistry]:
    registry = CollectorRegistry()
    planner = Planner(
        ScriptedObserver(observations),  # type: ignore[arg-type]
        connector,
        ReplicaPlanner(PROFILE, Targets(ttft_ms=200, itl_ms=10), ReplicaPolicy(max_step=8)),
        Predictors(*(make_predictor("constant") for _ in range(3))),
        interval_s=1.0,
        dry_run=dry_run,
        metrics=PlannerMetrics(registry),
    )
    return planner, registry


async def test_a_decision_is_applied_logged_and_exported(caplog: pytest.LogCaptureFixture) -> None:
    # 30 requests/s of 500 in, 100 out: 15k prompt tokens/s (2 prefill workers at 10k each),
    # 3k output tokens/s (3 decode workers at 1k each).
    connector = DryRunConnector(initial={"prefill": 1, "decode": 1})
    planner, registry = make_planner([load(30)], connector)
    with caplog.at_level(logging.INFO, logger="kvbaton.planner.planner"):
        decision = await planner.step()
    assert decision is not None and (decision.prefill, decision.decode) == (2, 3)
    assert connector.calls == [("prefill", 2), ("decode", 3)]
    (line,) = [r.getMessage() for r in caplog.records if "planner decision" in r.getMessage()]
    assert "prefill 1 -> 2, decode 1 -> 3" in line and "request_rate=30" in line
    assert registry.get_sample_value("kvbaton_planner_replicas", {"role": "decode"}) == 3
    assert registry.get_sample_value(
        "kvbaton_planner_demand_tokens_per_second", {"role": "prefill"}
    ) == pytest.approx(15_000)
    assert registry.get_sample_value("kvbaton_planner_decisions_total", {"applied": "true"}) == 1


async def test_dry_run_changes_nothing_and_a_failed_interval_neither() -> None:
    connector = DryRunConnector(initial={"prefill": 1, "decode": 1})
    planner, registry = make_planner([load(30), None], connector, dry_run=True)
    assert await planner.step() is not None
    assert await planner.step() is None  # no observation: no decision
    assert connector.calls == []
    assert registry.get_sample_value("kvbaton_planner_decisions_total", {"applied": "false"}) == 1


async def test_a_connector_that_fails_is_tried_again_at_the_next_interval() -> None:
    connector = FailingConnector(initial={"prefill": 1, "decode": 1})
    planner, registry = make_planner([load(30), load(30)], connector)
    assert await planner.step() is not None
    assert await planner.step() is not None
    assert registry.get_sample_value("kvbaton_planner_decisions_total", {"applied": "false"}) == 2


async def test_zero_traffic_keeps_the_minimum_and_no_nan() -> None:
    connector = DryRunConnector(initial={"prefill": 1, "decode": 1})
    planner, registry = make_planner([load(0, 0, 0) for _ in range(5)], connector)
    for _ in range(5):
        decision = await planner.step()
        assert decision is not None and (decision.prefill, decision.decode) == (1, 1)
    assert connector.calls == []
    value = registry.get_sample_value(
        "kvbaton_planner_demand_tokens_per_second", {"role": "decode"}
    )
    assert value == 0.0


METRICS = """\
# TYPE kvbaton_frontend_requests counter
kvbaton_frontend_requests_total{model="m",route="chat",status="200"} 90.0
kvbaton_frontend_requests_total{model="m",route="chat",status="400"} 10.0
kvbaton_frontend_requests_total{model="other",route="chat",status="200"} 1000.0
# TYPE kvbaton_frontend_inflight_requests gauge
kvbaton_frontend_inflight_requests{model="m"} 20.0
# TYPE kvbaton_frontend_input_tokens counter
kvbaton_frontend_input_tokens_total{model="m"} 50000.0
# TYPE kvbaton_frontend_output_tokens counter
kvbaton_frontend_output_tokens_total{model="m"} 10000.0
# TYPE kvbaton_frontend_input_sequence_tokens histogram
kvbaton_frontend_input_sequence_tokens_sum{model="m"} 45000.0
kvbaton_frontend_input_sequence_tokens_count{model="m"} 90.0
# TYPE kvbaton_frontend_output_sequence_tokens histogram
kvbaton_frontend_output_sequence_tokens_sum{model="m"} 2880.0
kvbaton_frontend_output_sequence_tokens_count{model="m"} 90.0
# TYPE kvbaton_frontend_time_to_first_token_seconds histogram
kvbaton_frontend_time_to_first_token_seconds_sum{model="m"} 20.0
kvbaton_frontend_time_to_first_token_seconds_count{model="m"} 100.0
# TYPE kvbaton_frontend_inter_token_latency_seconds histogram
kvbaton_frontend_inter_token_latency_seconds_sum{model="m"} 5.0
kvbaton_frontend_inter_token_latency_seconds_count{model="m"} 1000.0
"""


def worker(waiting: int, hit_rate: float) -> WorkerLoad:
    return WorkerLoad(
        instance_id=1,
        waiting=waiting,
        running=0,
        kv_blocks_total=10,
        kv_blocks_used=0,
        kv_blocks_free=10,
        prefix_cache_hit_rate=hit_rate,
    )


def test_an_interval_is_the_difference_of_two_looks() -> None:
    now = parse_totals(METRICS, "m", at=20.0)
    assert now.requests == 100 and now.input_tokens == 50_000
    assert parse_totals(METRICS, None, at=20.0).requests == 1100  # every model
    observation = interval(
        FrontendTotals(at=10.0), now, [worker(3, 0.5), worker(1, 0.3)], [worker(9, 0.0)]
    )
    # Arrivals: the 100 that finished and the 20 still in flight, over 10 s.
    assert observation.request_rate == pytest.approx(12.0)
    # Lengths: of the 90 that completed (status 200), not the token counters over all 100
    # (the output counter also counts the tokens of the 20 still running: 10,000 / 100).
    assert observation.avg_input_tokens == pytest.approx(500)
    assert observation.avg_output_tokens == pytest.approx(32)
    assert observation.ttft_ms == pytest.approx(200)
    assert observation.itl_ms == pytest.approx(5)
    # The prefill workers prefill: their queue and their cache hits are the ones that count.
    assert observation.queued_prefill == 4 and observation.prefix_hit_rate == pytest.approx(0.4)
    assert (observation.prefill_workers, observation.decode_workers) == (2, 1)
    quiet = interval(now, parse_totals(METRICS, "m", at=30.0), [], [])
    assert (quiet.request_rate, quiet.avg_input_tokens, quiet.ttft_ms) == (0.0, 0.0, 0.0)
