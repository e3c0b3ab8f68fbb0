"""bench/kv_tiers.py still runs and prints its comparison (figures are not judged here): on the
tiny chat model, the disk tier's configurations load later turns from disk, `off` never does."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import bench_headlines, run_bench

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_kv_tiers_bench_prints_each_configuration(chat_model: Path) -> None:
    out, rows = run_bench(
        "kv_tiers.py",
        "--model", str(chat_model),
        "--doc-tokens", "60", "100",
        "--sessions", "3",
        "--turns", "2",
        "--history-tokens", "8",
        "--output-tokens", "2",
        "--vocab", "300",
    )  # fmt: skip
    assert [r[0] for r in rows] == ["off", "disk-warm", "disk-cold"]
    disk_hits = {r[0]: float(r[8].rstrip("%")) for r in rows}
    assert disk_hits["off"] == 0 and disk_hits["disk-warm"] > 0 and disk_hits["disk-cold"] > 0
    assert "target:" in out
    heads = bench_headlines(out)
    assert [(h.benchmark, h.figure.split()[0]) for h in heads] == [
        ("kv_tiers", "disk-cold"),
        ("kv_tiers", "disk-warm"),
    ]
    cold, warm = heads
    assert cold.ratio is not None and cold.target and cold.met is not None
    assert warm.ratio is not None and warm.target == "" and warm.met is None
