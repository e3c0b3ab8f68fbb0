"""The router's Prometheus metrics: decision time, overlap found, worker chosen."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model", "mode"]
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
            "Requests sent to each worker",
            [*labels, "worker"],
            registry=registry,
        )
