"""The cluster as one frontend sees it: the JSON of `GET /v1/cluster`, which the page at
`/dashboard` shows (docs/cluster.md).

- Workers: every live instance with a card of a served model, joined by PID to the slots of the
  `kvbaton serve` processes on this frontend's discovery and host (runtime/serve_state.py). A
  slot's state wins: a worker whose child exited shows as restarting until its next child is
  ready, then as up. A worker of this host whose process is gone, or one seen before and no
  longer listed (with no slot to come back in), shows as gone for `GONE_KEPT_S`.
- Loads are this frontend's last poll of each worker; `age_s` says how old it is.
- Routing decisions are this frontend's own; workers, loads and the planner's decisions are
  the same for every frontend replica.
- Nothing is cached: each call reads the state as it is then.
- Each model's migrations, disaggregated prefills and unhealthy workers are also on the
  frontend's /metrics, read when scraped (`_ModelCounts`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvbaton.frontend.canary import Canary
from kvbaton.frontend.metrics import FrontendMetrics
from kvbaton.frontend.models import ModelManager, ServedModel
from kvbaton.frontend.shedding import LoadMonitor
from kvbaton.protocols.discovery import Instance
from kvbaton.protocols.llm import ModelCard
from kvbaton.protocols.planner import PlannerReport, planner_reports_prefix
from kvbaton.router.decisions import Choice
from kvbaton.router.policies import Router
from kvbaton.router.prefill_router import SETTLE_S
from kvbaton.runtime import Client
from kvbaton.runtime.serve_state import alive, read_states

GONE_KEPT_S = 600.0
ROUTES_SHOWN = 50
_SLOT_STATES = {"new": "starting", "starting": "starting", "ready": "up", "backoff": "restarting"}


@dataclass
class _Pool:
    """The workers of one role of one model, as this frontend follows them."""

    model: str
    role: str
    client: Client
    cards: dict[int, ModelCard]
    router: Router
    loads: LoadMonitor | None
    canary: Canary | None = None


def _pools(model: ServedModel) -> list[_Pool]:
    pools = [
        _Pool(model.name, "", model.client, model.cards, model.router, model.loads, model.canary)
    ]
    prefill = model.prefill
    if prefill.router is not None:
        pools.append(
            _Pool(
                model.name,
                "prefill",
                prefill.router.client,
                prefill.cards,
                prefill.router.router,
                prefill.loads,
            )
        )
    return pools


def _slot_state(slot: dict[str, Any]) -> str:
    state = _SLOT_STATES.get(slot.get("state", ""), "stopping")
    return "restarting" if state == "starting" and slot.get("restarts") else state


def _choice(choice: Choice | None) -> dict[str, Any] | None:
    if choice is None:
        return None
    return {
        "worker": f"{choice.worker_id:x}",
        "overlap_blocks": choice.overlap_blocks,
        "cost": choice.cost,
    }


def _load(loads: LoadMonitor | None, worker: int) -> dict[str, Any] | None:
    load = loads.loads.get(worker) if loads is not None else None
    if loads is None or load is None:
        return None
    return {
        "age_s": round(loads.age(worker), 3),
        "running": load.running,
        "waiting": load.waiting,
        "kv_blocks_used": load.kv_blocks_used,
        "kv_blocks_free": load.kv_blocks_free,
        "kv_blocks_total": load.kv_blocks_total,
        "prefix_cache_hit_rate": load.prefix_cache_hit_rate,
        "kv_handoffs": load.kv_handoffs,
        "kv_transfer_bytes": load.kv_transfer_bytes,
        "kv_transfer_seconds": load.kv_transfer_seconds,
        "kv_handoff_wait_seconds": load.kv_handoff_wait_seconds,
        "compiled_decode": load.compiled_decode,
    }


class _ModelCounts(Collector):
    """Each served model's counts on /metrics, read from the model when scraped."""

    def __init__(self, models: ModelManager) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        prefix = "kvbaton_frontend"
        migrations = CounterMetricFamily(
            f"{prefix}_migrations",
            "Lost attempts whose request was sent again (migrated)",
            labels=["model"],
        )
        prefills = CounterMetricFamily(
            f"{prefix}_disaggregated_prefills",
            "Prefills sent to prefill workers, by outcome (answered; fallback: the decode "
            "worker prefilled; failure: the request failed; unsettled: cancelled, still running "
            f"{SETTLE_S:g} s after its request was answered)",
            labels=["model", "outcome"],
        )
        unhealthy = GaugeMetricFamily(
            f"{prefix}_unhealthy_workers",
            "Workers passed over until they pass a canary (all are tried when all are)",
            labels=["model"],
        )
        for model in list(self.models.models.values()):
            migrations.add_metric([model.name], model.migrations)
            if model.prefill.router is not None:
                outcomes = model.prefill.router.outcomes
                prefills.add_metric([model.name, "answered"], outcomes.answered)
                prefills.add_metric([model.name, "fallback"], outcomes.fallbacks)
                prefills.add_metric([model.name, "failure"], outcomes.failures)
                prefills.add_metric([model.name, "unsettled"], outcomes.unsettled)
            sick = model.canary.unhealthy_live() if model.canary is not None else set()
            unhealthy.add_metric([model.name], len(sick))
        yield migrations
        yield prefills
        yield unhealthy


class ClusterView:
    def __init__(self, models: ModelManager, metrics: FrontendMetrics) -> None:
        """Also exports the models' counts on `metrics`' registry."""
        self.models = models
        self.metrics = metrics
        metrics.registry.register(_ModelCounts(models))
        self.started_at = time.time()
        self._host = socket.gethostname()
        self._gone: dict[str, tuple[float, dict[str, Any]]] = {}  # name -> (seen at, its row)
        self._slot_pids: set[int] = set()  # PIDs seen in a slot, of instances still listed

    async def snapshot(self) -> dict[str, Any]:
        served = [self.models.models[n] for n in sorted(self.models.models)]
        pools = [pool for model in served for pool in _pools(model)]
        slots = [
            slot
            for state in read_states(self.models.runtime.settings.discovery)
            for slot in state.get("slots", [])
        ]
        return {
            "at": time.time(),
            "frontend": {
                "pid": os.getpid(),
                "started_at": self.started_at,
                "requests_ended": self.metrics.window.ended,
            },
            "frontends": [self._slot_row(s) for s in slots if s.get("role") == "frontend"],
            "models": [self._model(m) for m in served],
            "workers": self._workers(pools, [s for s in slots if s.get("role") != "frontend"]),
            "requests": {
                "step_s": self.metrics.window.step_s,
                "span_s": self.metrics.window.span_s,
                "points": self.metrics.window.points(),
            },
            "routes": self._routes(pools),
            "planner": await self._planner(),
        }

    def _model(self, model: ServedModel) -> dict[str, Any]:
        prefill = model.prefill.router
        return {
            "name": model.name,
            "context_length": model.card.context_length,
            "kv_block_size": model.card.kv_block_size,
            "router": model.router.mode,
            "workers": len(model.instance_ids()),
            "prefill_workers": len(model.prefill.live()),
            "disaggregated": None if prefill is None else dataclasses.asdict(prefill.outcomes),
            "migrations": model.migrations,
        }

    def _slot_row(self, slot: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": slot.get("name", ""),
            "state": _slot_state(slot),
            "pid": slot.get("pid"),
            "restarts": slot.get("restarts", 0),
            "last_exit": slot.get("last_exit", ""),
        }

    def _local(self, instance: Instance) -> bool:
        return instance.hostname in ("", self._host)

    def _workers(self, pools: list[_Pool], slots: list[dict[str, Any]]) -> list[dict[str, Any]]:
        by_pid = {s["pid"]: s for s in slots if s.get("pid")}
        instances = [(pool, instance) for pool in pools for instance in pool.client.instances()]
        # Bounded: a PID that neither a slot nor a listed instance names now is not kept.
        self._slot_pids = (self._slot_pids & {i.pid for _, i in instances}) | by_pid.keys()
        rows: dict[str, dict[str, Any]] = {}
        for pool, instance in instances:
            card = pool.cards.get(instance.instance_id)
            local = self._local(instance)
            if card is None or (
                local and instance.pid in self._slot_pids and instance.pid not in by_pid
            ):
                continue  # (an earlier child of a slot: the slot's row stands for it)
            slot = by_pid.get(instance.pid) if local else None
            row: dict[str, Any] = (
                self._slot_row(slot)
                if slot is not None
                else {
                    "name": f"{instance.instance_id:x}",
                    "state": "up",
                    "pid": instance.pid or None,
                    "restarts": None,
                    "last_exit": "",
                }
            )
            if slot is None and local and instance.pid:
                row["state"] = "up" if alive(instance.pid) else "gone"
            worker = instance.instance_id
            row |= {
                "instance": f"{worker:x}",
                "model": pool.model,
                "role": pool.role or card.role,
                "in_flight": pool.router.in_flight.get(worker, 0),
                "load": _load(pool.loads, worker),
                "healthy": pool.canary is None or worker not in pool.canary.unhealthy,
                "slot": slot is not None,
            }
            rows[row["name"]] = row
        for slot in slots:
            if slot.get("name", "") not in rows:
                rows[slot["name"]] = self._slot_row(slot) | {
                    "instance": None,
                    "model": None,
                    "role": slot.get("role", ""),
                    "in_flight": 0,
                    "load": None,
                    "healthy": True,
                    "slot": True,
                }
        now = time.time()
        for name, row in rows.items():
            if not row["slot"]:
                self._gone[name] = (now, row)
        for name, (seen, row) in list(self._gone.items()):
            if now - seen > GONE_KEPT_S:
                del self._gone[name]
            elif name not in rows:
                rows[name] = row | {"state": "gone", "in_flight": 0, "load": None, "healthy": True}
        return sorted(rows.values(), key=lambda r: (r["role"], r["name"]))

    def _routes(self, pools: list[_Pool]) -> list[dict[str, Any]]:
        routes: list[dict[str, Any]] = [
            {
                "at": d.at,
                "model": pool.model,
                "pool": pool.role or "decode or aggregated",
                "mode": pool.router.mode,
                "chosen": _choice(d.chosen),
                "runner_up": _choice(d.runner_up),
            }
            for pool in pools
            for d in pool.router.decisions.last()
        ]
        routes.sort(key=lambda r: r["at"], reverse=True)
        return routes[:ROUTES_SHOWN]

    async def _planner(self) -> dict[str, Any] | None:
        """The planners' decisions, newest first (None: no planner publishes any)."""
        prefix = planner_reports_prefix(self.models.namespace)
        values = await self.models.runtime.discovery.get_prefix(prefix)
        if not values:
            return None
        decisions = []
        interval = 0.0
        for value in values.values():
            try:
                report = msgspec.json.decode(value, type=PlannerReport)
            except msgspec.DecodeError:
                continue  # not a planner's report: not ours to show
            interval = report.interval_s
            decisions += [msgspec.to_builtins(d) for d in report.decisions]
        decisions.sort(key=lambda d: d["at"], reverse=True)
        return {"interval_s": interval, "decisions": decisions}
