"""The frontend's metrics: Prometheus's (one registry per frontend, served at /metrics), and the
last minutes of its requests for the cluster page (`request_window.py`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbaton.frontend.request_window import RequestWindow

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0
)  # fmt: skip
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_LENGTH_BUCKETS = tuple(4.0**i for i in range(11))  # 1 to 1,048,576 tokens


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.window = RequestWindow()
        self._models: dict[str, ModelMetrics] = {}
        r = self.registry
        prefix = "kvbaton_frontend"
        self.requests = Counter(
            f"{prefix}_requests",
            "HTTP requests to the model routes, by final status",
            ["model", "route", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            f"{prefix}_inflight_requests", "Requests being served", ["model"], registry=r
        )
        self.ttft = Histogram(
            f"{prefix}_time_to_first_token_seconds",
            "From request arrival to the first output token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{prefix}_inter_token_latency_seconds",
            "Between two output tokens of one request (averaged over a burst of tokens)",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.input_tokens = Counter(
            f"{prefix}_input_tokens", "Prompt tokens", ["model"], registry=r
        )
        self.output_tokens = Counter(
            f"{prefix}_output_tokens", "Generated tokens", ["model"], registry=r
        )
        # Lengths per request, observed when it completes: their means are exact (the token
        # counters above also count requests still running, and so do not divide by requests).
        self.input_sequence_tokens = Histogram(
            f"{prefix}_input_sequence_tokens",
            "Prompt tokens of each completed request (status 200)",
            ["model"],
            buckets=_LENGTH_BUCKETS,
            registry=r,
        )
        self.output_sequence_tokens = Histogram(
            f"{prefix}_output_sequence_tokens",
            "Generated tokens of each completed request (status 200)",
            ["model"],
            buckets=_LENGTH_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            f"{prefix}_request_duration_seconds",
            "From request arrival to its last byte",
            ["model"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )

    def follow_kept(self, count: Callable[[], float], size: Callable[[], float]) -> None:
        """Gauges of the Responses API's kept responses (`response_store.py`), read at scrape."""
        prefix = "kvbaton_frontend_kept_responses"
        Gauge(prefix, "Responses API responses kept here", registry=self.registry).set_function(
            count
        )
        Gauge(
            f"{prefix}_bytes",
            "Their size as JSON (at most --responses-store-mib)",
            registry=self.registry,
        ).set_function(size)

    def of_model(self, model: str) -> ModelMetrics:
        """The metrics of one model, labelled once (labelling costs more than observing)."""
        if model not in self._models:
            self._models[model] = ModelMetrics(self, model)
        return self._models[model]


class ModelMetrics:
    def __init__(self, metrics: FrontendMetrics, model: str) -> None:
        self._requests = metrics.requests
        self.model = model
        self.in_flight = metrics.in_flight.labels(model)
        self.ttft = metrics.ttft.labels(model)
        self.itl = metrics.itl.labels(model)
        self.input_tokens = metrics.input_tokens.labels(model)
        self.output_tokens = metrics.output_tokens.labels(model)
        self.input_sequence_tokens = metrics.input_sequence_tokens.labels(model)
        self.output_sequence_tokens = metrics.output_sequence_tokens.labels(model)
        self.duration = metrics.duration.labels(model)

    @cache  # noqa: B019 (one per model, kept for the frontend's life)
    def requests(self, route: str, status: int) -> Any:
        return self._requests.labels(self.model, route, str(status))
