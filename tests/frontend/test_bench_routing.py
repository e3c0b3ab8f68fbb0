"""bench/routing.py still runs end to end (a few requests per mode) and prints every mode, the
verdict lines, the decision cost and its headlines (figures are not judged here: speed is for
the benchmark)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import bench_headlines, run_bench


@pytest.mark.integration
@pytest.mark.timeout(300)  # four deployments on a busy 2-core machine
def test_routing_bench_prints_every_mode(chat_model: Path) -> None:
    out, rows = run_bench(
        "routing.py",
        "--model",
        str(chat_model),
        "--sessions",
        "4",
        "--turns",
        "2",
        "--system-prompts",
        "2",
        "--system-tokens",
        "80",
        "--first-user-tokens",
        "40",
        "--user-tokens",
        "20",
        "--max-tokens",
        "4",
        "--speedup-ratio",
        "10",
        "--repeats",
        "1",
        "--modes",
        "round-robin,kv,kv-approx,kv-2-frontends",
        "--decision-blocks",
        "20000",
        "--decision-workers",
        "4",
        "--decision-prompt",
        "256",
    )
    names = ("round-robin", "kv", "kv-approx", "kv-2-frontends")
    modes = {row[0]: row for row in rows if row[0] in names}
    assert set(modes) == set(names)
    for row in modes.values():
        assert 0 <= float(row[1].rstrip("%")) <= 100  # hit rate
        assert float(row[3]) > 0  # TTFT p50 ms
    decisions = [row for row in rows if row[0].isdigit()]
    assert [row[0] for row in decisions] == ["64", "16"]
    assert "kv: hit rate" in out and "its fair share" in out
    assert "kv-2-frontends: hit rate" in out
    heads = bench_headlines(out)
    # kv against the best and round-robin, its busiest worker; two frontends against one
    assert [h.benchmark for h in heads] == ["routing"] * 5, out
    assert all(h.ratio is not None and h.target and h.met is not None for h in heads), heads
