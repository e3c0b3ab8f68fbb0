"""What the planner sees each interval: the frontend's Prometheus metrics (request arrival rate,
input and output lengths, TTFT, ITL) and each worker's load (queue, prefix-cache hits).

Invariants: an `Observation` covers the time between two looks; rates and means come from the
differences of the frontend's counters and histogram sums, so they describe that interval only
(a frontend that restarted, whose counters went back, counts from zero again); a look that
fails (frontend or worker unreachable within the timeout) raises `ObserveError` and leaves the
previous look in place, so the next interval covers both."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvbaton.planner.types import Observation
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import Client, DistributedRuntime

SCRAPE_TIMEOUT_S = 5.0
PREFIX = "kvbaton_frontend_"


class ObserveError(Exception):
    pass


@dataclass
class FrontendTotals:
    """The frontend's counters at one moment (summed over models, or for one model)."""

    at: float
    requests: float = 0.0
    input_tokens: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    in_flight: float = 0.0
    isl_sum: float = 0.0  # lengths of the requests completed (status 200)
    isl_count: float = 0.0
    osl_sum: float = 0.0
    osl_count: float = 0.0


_SAMPLES = {
    f"{PREFIX}requests_total": "requests",
    f"{PREFIX}input_tokens_total": "input_tokens",
    f"{PREFIX}time_to_first_token_seconds_sum": "ttft_sum",
    f"{PREFIX}time_to_first_token_seconds_count": "ttft_count",
    f"{PREFIX}inter_token_latency_seconds_sum": "itl_sum",
    f"{PREFIX}inter_token_latency_seconds_count": "itl_count",
    f"{PREFIX}inflight_requests": "in_flight",
    f"{PREFIX}input_sequence_tokens_sum": "isl_sum",
    f"{PREFIX}input_sequence_tokens_count": "isl_count",
    f"{PREFIX}output_sequence_tokens_sum": "osl_sum",
    f"{PREFIX}output_sequence_tokens_count": "osl_count",
}


def parse_totals(text: str, model: str | None, at: float) -> FrontendTotals:
    """The counters in a /metrics page, for `model` (None: every model)."""
    totals = FrontendTotals(at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = _SAMPLES.get(sample.name)
            if name is None or (model is not None and sample.labels.get("model") != model):
                continue
            setattr(totals, name, getattr(totals, name) + sample.value)
    return totals


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
        return str(response.read().decode())


class Observer:
    def __init__(
        self,
        runtime: DistributedRuntime,
        frontend_url: str,
        namespace: str,
        *,
        model: str | None = None,
        prefill_component: str = "prefill",
        decode_component: str = "backend",
    ) -> None:
        self.runtime = runtime
        self.metrics_url = frontend_url.rstrip("/") + "/metrics"
        self.model = model
        self._paths = {
            "prefill": f"{namespace}.{prefill_component}.load_metrics",
            "decode": f"{namespace}.{decode_component}.load_metrics",
        }
        self._clients: dict[str, Client] = {}
        self._last: FrontendTotals | None = None

    async def start(self) -> None:
        """Take the first look (the first interval starts here)."""
        for role, path in self._paths.items():
            self._clients[role] = await self.runtime.endpoint(path).client(response_type=WorkerLoad)
        self._last = await self._totals()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()

    async def _totals(self) -> FrontendTotals:
        try:
            text = await asyncio.to_thread(_fetch, self.metrics_url)
        except OSError as exc:
            raise ObserveError(f"cannot read {self.metrics_url}: {exc}") from exc
        return parse_totals(text, self.model, time.monotonic())

    async def loads(self, role: str) -> list[WorkerLoad]:
        """The load of every live worker of `role` (those that do not answer in time: left out)."""
        client = self._clients[role]

        async def one(instance_id: int) -> WorkerLoad | None:
            try:
                async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                    load: WorkerLoad = await anext(aiter(client.direct(None, instance_id)))
                    return load
            except Exception:  # leaving, or busy past the timeout: not counted this time
                return None

        found = await asyncio.gather(*(one(i) for i in client.instance_ids()))
        return [load for load in found if load is not None]

    async def observe(self) -> Observation:
        """The interval since the last look."""
        assert self._last is not None, "start() first"
        now = await self._totals()
        prefill, decode = await asyncio.gather(self.loads("prefill"), self.loads("decode"))
        before = self._last
        if now.requests < before.requests or now.input_tokens < before.input_tokens:
            before = FrontendTotals(before.at)  # the frontend restarted: its counters too
        self._last = now
        return interval(before, now, prefill, decode)


def interval(
    before: FrontendTotals,
    now: FrontendTotals,
    prefill: list[WorkerLoad],
    decode: list[WorkerLoad],
) -> Observation:
    """The Observation between two looks, with the workers' loads at the second."""
    seconds = max(now.at - before.at, 1e-9)
    requests = now.requests - before.requests  # finished in the interval
    # Arrivals, not completions: those still in flight count too (an overloaded deployment
    # finishes fewer requests than it is sent; planning on its throughput would never grow it).
    arrivals = max(0.0, requests + now.in_flight - before.in_flight)
    ttft_n = now.ttft_count - before.ttft_count
    itl_n = now.itl_count - before.itl_count
    isl_n = now.isl_count - before.isl_count
    osl_n = now.osl_count - before.osl_count
    # Prompts are prefilled (and found in the cache) on the prefill workers when there are any.
    prefillers = prefill or decode
    hit_rate = (
        sum(w.prefix_cache_hit_rate for w in prefillers) / len(prefillers) if prefillers else 0.0
    )
    return Observation(
        interval_s=seconds,
        request_rate=arrivals / seconds,
        # Per completed request: the output tokens counter also counts requests still running,
        # and over 5 s its ratio to the requests that ended wandered from 14 to 250 for 32.
        avg_input_tokens=(now.isl_sum - before.isl_sum) / isl_n if isl_n else 0.0,
        avg_output_tokens=(now.osl_sum - before.osl_sum) / osl_n if osl_n else 0.0,
        ttft_ms=1000 * (now.ttft_sum - before.ttft_sum) / ttft_n if ttft_n else 0.0,
        itl_ms=1000 * (now.itl_sum - before.itl_sum) / itl_n if itl_n else 0.0,
        prefix_hit_rate=hit_rate,
        queued_prefill=sum(w.waiting for w in prefillers),
        prefill_workers=len(prefill),
        decode_workers=len(decode),
    )
