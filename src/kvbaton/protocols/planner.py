"""What a planner tells the frontends: its last decisions, kept in discovery for the cluster
page (`GET /v1/cluster`, docs/cluster.md).

- One key per planner, `/planner/{namespace}/{instance:x}`, owned by its lease: it goes with the
  planner.
- The value is a `PlannerReport`, rewritten whole at each decision: at most `KEPT` decisions,
  newest last.
"""

from __future__ import annotations

import msgspec

PLANNER_ROOT = "/planner/"
KEPT = 20


def planner_reports_prefix(namespace: str) -> str:
    return f"{PLANNER_ROOT}{namespace}/"


def planner_report_key(namespace: str, instance_id: int) -> str:
    return f"{planner_reports_prefix(namespace)}{instance_id:x}"


class PlannedPool(msgspec.Struct, kw_only=True):
    role: str  # "prefill" or "decode"
    current: int  # workers when the decision was made
    wanted: int  # workers decided


class PlannerDecision(msgspec.Struct, kw_only=True):
    at: float  # seconds since the epoch
    pools: list[PlannedPool]
    applied: bool  # the connector scaled the pools (False: dry run, or it failed)
    dry_run: bool
    predicted_request_rate: float  # requests/s
    reasons: list[str]  # every step that shaped the counts


class PlannerReport(msgspec.Struct, kw_only=True):
    interval_s: float
    decisions: list[PlannerDecision]
