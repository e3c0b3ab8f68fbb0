"""The planner's decisions reach the frontends: published in discovery under the planner's
lease, the last `KEPT` only, and read back by a frontend's cluster view."""

from __future__ import annotations

import uuid

import msgspec
import pytest

from kvbaton.frontend.cluster import ClusterView
from kvbaton.frontend.metrics import FrontendMetrics
from kvbaton.frontend.models import ModelManager
from kvbaton.planner.reports import DecisionReports
from kvbaton.planner.types import Decision
from kvbaton.protocols.planner import KEPT, PlannerReport, planner_reports_prefix
from kvbaton.runtime import DistributedRuntime

pytestmark = pytest.mark.unit


def decision(decode: int) -> Decision:
    return Decision(
        prefill=1,
        decode=decode,
        predicted_request_rate=2.5,
        predicted_input_tokens=100,
        predicted_output_tokens=10,
        prefill_demand=250,
        decode_demand=25,
        prefill_capacity=1000,
        decode_capacity=10,
        reasons=[f"decode: scale up 1 -> {decode}"],
    )


async def test_the_last_decisions_are_published_and_a_frontend_reads_them() -> None:
    discovery = f"mem://{uuid.uuid4().hex}"
    async with (
        DistributedRuntime(discovery) as planner,
        DistributedRuntime(discovery) as frontend,
    ):
        view = ClusterView(ModelManager(frontend, "ns"), FrontendMetrics())
        assert (await view.snapshot())["planner"] is None  # no planner yet

        reports = DecisionReports(planner, "ns", interval_s=5.0)
        for decode in range(1, KEPT + 4):
            await reports.publish(decision(decode), {"prefill": 1, "decode": 1}, True, False)

        (value,) = (await planner.discovery.get_prefix(planner_reports_prefix("ns"))).values()
        report = msgspec.json.decode(value, type=PlannerReport)
        assert len(report.decisions) == KEPT
        assert report.decisions[-1].pools[1].wanted == KEPT + 3  # newest last

        shown = (await view.snapshot())["planner"]
        assert shown["interval_s"] == 5.0
        newest = shown["decisions"][0]
        assert newest["pools"] == [
            {"role": "prefill", "current": 1, "wanted": 1},
            {"role": "decode", "current": 1, "wanted": KEPT + 3},
        ]
        assert newest["applied"] and not newest["dry_run"]
        assert newest["reasons"] == [f"decode: scale up 1 -> {KEPT + 3}"]

    async with DistributedRuntime(discovery) as reader:  # the planner's lease went with it
        assert await reader.discovery.get_prefix(planner_reports_prefix("ns")) == {}
