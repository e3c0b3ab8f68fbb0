"""A worker's tier counts on /metrics: every figure of its load report, by tier where it has
one; nothing without tiers."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvbaton.protocols.llm import KvTierStats
from kvbaton.workers.tier_metrics import TierCollector

pytestmark = pytest.mark.unit


def scrape(stats: KvTierStats | None) -> str:
    registry = CollectorRegistry()
    registry.register(TierCollector(lambda: stats))
    return generate_latest(registry).decode()


def test_tier_counts_are_exported_by_tier() -> None:
    text = scrape(
        KvTierStats(
            host_blocks=3,
            disk_bytes=4096,
            disk_capacity_bytes=2**30,
            hit_blocks_disk=7,
            loads=2,
            load_seconds=0.25,
            written_blocks=5,
            disk_writable=True,
        )
    )
    for line in [
        'kvbaton_kv_tier_blocks{tier="host"} 3.0',
        'kvbaton_kv_tier_bytes{tier="disk"} 4096.0',
        'kvbaton_kv_tier_capacity_bytes{tier="disk"} 1.073741824e+09',
        'kvbaton_kv_tier_hit_blocks_total{tier="disk"} 7.0',
        "kvbaton_kv_tier_loads_total 2.0",
        "kvbaton_kv_tier_load_seconds_total 0.25",
        "kvbaton_kv_tier_written_blocks_total 5.0",
        "kvbaton_kv_tier_disk_writable 1.0",
    ]:
        assert line in text.splitlines()


def test_nothing_without_tiers() -> None:
    assert "kvbaton_kv_tier" not in scrape(None)
