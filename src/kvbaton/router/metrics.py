"""The router's Prometheus metrics: decision time, overlap found, worker chosen, and the
blocks its KV index holds per worker, in its pool and in the tiers below it (read from the
index when scraped)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class IndexView(Protocol):
    @property
    def workers(self) -> list[int]: ...

    def tree_size(self, worker_id: int) -> int: ...

    def tier_sizes(self, worker_id: int) -> dict[str, int]: ...


class _IndexedBlocks(Collector):
    def __init__(self) -> None:
        self.indexes: dict[tuple[str, str], IndexView] = {}  # (model, component) -> index

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvbaton_router_indexed_blocks",
            "Blocks the router's KV index holds for each worker",
            labels=["model", "component", "worker"],
        )
        tiers = GaugeMetricFamily(
            "kvbaton_router_indexed_tier_blocks",
            "Blocks the router's KV index holds below each worker's pool (disk: its store's)",
            labels=["model", "component", "worker", "tier"],
        )
        for (model, component), index in list(self.indexes.items()):
            for worker in index.workers:
                family.add_metric([model, component, f"{worker:x}"], index.tree_size(worker))
                for tier, size in index.tier_sizes(worker).items():
                    tiers.add_metric([model, component, f"{worker:x}", tier], size)
        yield family
        yield tiers


class RouterMetrics:
    """Every metric is per model and per component ("namespace.component" of the workers
    routed to: a disaggregating frontend's prefill and decode workers are two) and mode."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model", "component", "mode"]
        self.decision_seconds = Histogram(
            "kvbaton_router_decision_seconds",
            "Time to rank the workers for one request",
            labels,
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
            registry=registry,
        )
        self.overlap_blocks = Histogram(
            "kvbaton_router_overlap_blocks",
            "Prompt blocks the chosen worker had cached, as the router's index saw it",
            labels,
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=registry,
        )
        self.routed = Counter(
            "kvbaton_router_requests",
            "Requests each worker took (a request passed on by a worker counts on both)",
            [*labels, "worker"],
            registry=registry,
        )
        self._indexed = _IndexedBlocks()
        registry.register(self._indexed)

    def forget_worker(self, model: str, component: str, mode: str, worker_id: int) -> None:
        """Drop the series of a worker that left (a no-op for one never counted)."""
        with contextlib.suppress(KeyError):  # (older prometheus_client versions raise it)
            self.routed.remove(model, component, mode, f"{worker_id:x}")

    def watch_index(self, model: str, component: str, index: IndexView | None) -> None:
        """Export `index`'s blocks per worker of `component` ("namespace.component");
        None stops exporting."""
        if index is None:
            self._indexed.indexes.pop((model, component), None)
        else:
            self._indexed.indexes[(model, component)] = index
