"""A worker's KV tiers on its `/metrics` (the system server's registry): per tier, blocks,
bytes, capacity and blocks loaded; loads, their failures and time; blocks offloaded, written,
dropped and rejected.

- Read at scrape time from the engine's last stats snapshot; nothing when it has no tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvbaton.protocols.llm import KvTierStats

PREFIX = "kvbaton_kv_tier"


class TierCollector(Collector):
    def __init__(self, stats: Callable[[], KvTierStats | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:
            return
        per_tier: list[tuple[str, str, dict[str, float]]] = [
            ("blocks", "blocks held", {"host": s.host_blocks, "disk": s.disk_blocks}),
            ("bytes", "bytes held", {"host": s.host_bytes, "disk": s.disk_bytes}),
            (
                "capacity_bytes",
                "bytes the tier may hold",
                {"host": s.host_capacity_bytes, "disk": s.disk_capacity_bytes},
            ),
        ]
        for name, doc, values in per_tier:
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", f"KV tier {doc}", labels=["tier"])
            for tier, value in values.items():
                gauge.add_metric([tier], value)
            yield gauge
        hits = CounterMetricFamily(
            f"{PREFIX}_hit_blocks", "blocks loaded into the pool from a tier", labels=["tier"]
        )
        hits.add_metric(["host"], s.hit_blocks_host)
        hits.add_metric(["disk"], s.hit_blocks_disk)
        yield hits
        for name, doc, value in [
            ("loads", "prompt loads from the tiers", s.loads),
            (
                "load_failures",
                "loads that missed a block (the prompt was computed)",
                s.load_failures,
            ),
            ("load_seconds", "time spent loading from the tiers", s.load_seconds),
            (
                "offloaded_blocks",
                "blocks evicted from the pool and kept below it",
                s.offloaded_blocks,
            ),
            ("written_blocks", "blocks written to the disk tier", s.written_blocks),
            ("dropped_blocks", "offloaded blocks not written to disk", s.dropped_blocks),
            ("rejected_blocks", "disk tier files that failed verification", s.rejected_blocks),
        ]:
            yield CounterMetricFamily(f"{PREFIX}_{name}", f"KV tier {doc}", value=value)
        writable = GaugeMetricFamily(
            f"{PREFIX}_disk_writable", "1 while the disk tier takes blocks"
        )
        writable.add_metric([], float(s.disk_writable))
        yield writable
