"""A router's last decisions, for the cluster page: the worker that took the request, its
overlap and cost, and the runner-up; bounded."""

from __future__ import annotations

import pytest

from kvbaton.router.decisions import DecisionLog
from kvbaton.router.indexer import KvIndexer
from kvbaton.router.kv_router import KvRouter
from kvbaton.router.policies import RoundRobinRouter, RouteRequest

pytestmark = pytest.mark.unit

BLOCK = 4


def test_the_kv_router_records_the_chosen_worker_and_the_runner_up() -> None:
    router = KvRouter(KvIndexer(), BLOCK)
    prompt = list(range(16))
    route = router.route(RouteRequest(prompt), [1, 2])
    route.start(route.ranking[0])
    (decision,) = router.decisions.last()
    chosen, other = route.ranking
    assert decision.chosen.worker_id == chosen
    assert decision.chosen.overlap_blocks == 0
    assert decision.chosen.cost == route.costs[chosen]
    assert decision.runner_up is not None and decision.runner_up.worker_id == other
    assert decision.runner_up.cost == route.costs[other]
    route.done()


def test_a_simple_router_records_no_overlap_nor_cost_and_one_worker_no_runner_up() -> None:
    router = RoundRobinRouter()
    route = router.route(RouteRequest([1, 2, 3]), [7])
    route.start(7)
    (decision,) = router.decisions.last()
    assert decision.chosen.worker_id == 7
    assert decision.chosen.overlap_blocks is None and decision.chosen.cost is None
    assert decision.runner_up is None


def test_the_log_keeps_the_last_decisions_only() -> None:
    log = DecisionLog()
    for worker in range(DecisionLog.size + 5):
        log.record(worker, [worker], {}, {})
    kept = [d.chosen.worker_id for d in log.last()]
    assert kept == list(range(5, DecisionLog.size + 5))
