"""The planner's last decisions, published in discovery for the frontends' cluster page
(`protocols/planner.py`).

- Each decision is published once it was applied (or not); a failed publication is logged and
  never holds up the planner: the next decision publishes all the kept ones again.
"""

from __future__ import annotations

import collections
import logging
import time

import msgspec

from kvbaton.planner.types import Decision
from kvbaton.protocols.planner import (
    KEPT,
    PlannedPool,
    PlannerDecision,
    PlannerReport,
    planner_report_key,
)
from kvbaton.runtime import DistributedRuntime

log = logging.getLogger(__name__)


class DecisionReports:
    def __init__(self, runtime: DistributedRuntime, namespace: str, interval_s: float) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.interval_s = interval_s
        self._kept: collections.deque[PlannerDecision] = collections.deque(maxlen=KEPT)

    async def publish(
        self, decision: Decision, current: dict[str, int], applied: bool, dry_run: bool
    ) -> None:
        wanted = {"prefill": decision.prefill, "decode": decision.decode}
        self._kept.append(
            PlannerDecision(
                at=time.time(),
                pools=[
                    PlannedPool(role=role, current=current.get(role, 0), wanted=count)
                    for role, count in wanted.items()
                ],
                applied=applied,
                dry_run=dry_run,
                predicted_request_rate=decision.predicted_request_rate,
                reasons=list(decision.reasons),
            )
        )
        report = PlannerReport(interval_s=self.interval_s, decisions=list(self._kept))
        try:
            key = planner_report_key(self.namespace, await self.runtime.ensure_instance_id())
            await self.runtime.publish(key, msgspec.json.encode(report))
        except Exception as exc:
            log.warning("planner: could not publish the decision for the frontends: %s", exc)
