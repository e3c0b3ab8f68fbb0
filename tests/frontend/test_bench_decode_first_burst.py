"""bench/decode_first_burst.py still runs end to end (a small burst per transfer order, on the
tiny model): both orders and their ratio are printed, the figures parse and are positive, and
the headlines compare the orders (their size is for the benchmark to judge)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import bench_headlines, run_bench


@pytest.mark.integration
@pytest.mark.timeout(300)  # two deployments on a busy 2-core machine
def test_decode_first_burst_bench_runs_both_orders(chat_model: Path) -> None:
    out, rows = run_bench(
        "decode_first_burst.py",
        *("--model", str(chat_model), "--prefill-workers", "2", "--requests", "4"),
        *("--prompt", "100,150", "--repeats", "1"),
    )
    table = {row[0]: [float(cell) for cell in row[1:]] for row in rows}
    assert set(table) == {"prefill-first", "decode-first", "decode-first / prefill-first"}
    for order, figures in table.items():
        assert len(figures) == 4 and all(f > 0 for f in figures), order
        if order != "decode-first / prefill-first":  # TTFT p50 <= p90 <= max <= last end
            assert figures == sorted(figures), order
    assert "1 decode + 2 prefill workers" in out
    heads = bench_headlines(out)  # TTFT p90 and last end, decode-first against prefill-first
    assert [h.benchmark for h in heads] == ["decode_first_burst"] * 2, out
    assert all(h.ratio is not None and h.target == "" and h.met is None for h in heads), heads
