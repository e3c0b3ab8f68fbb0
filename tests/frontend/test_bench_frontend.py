"""bench/frontend.py still runs and prints both paths, its verdict lines and its headlines
(figures are not judged here: speed is for the benchmark, not for asserts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import bench_headlines, run_bench


@pytest.mark.integration
def test_frontend_bench_prints_frontend_and_direct(chat_model: Path) -> None:
    out, rows = run_bench(
        "frontend.py",
        "--model",
        str(chat_model),
        "--requests",
        "50",
        "--duration",
        "0.3",
        "--trials",
        "1",
    )
    cells = {(r[0], r[1].split()[0]) for r in rows}
    assert cells == {(c, p) for c in ("1", "64") for p in ("frontend", "direct")}
    for row in rows:
        assert float(row[2].replace(",", "")) > 0  # requests/s
    assert "added latency at p50" in out and "frontend requests/s at concurrency 64" in out
    heads = bench_headlines(out)  # added latency at concurrency 1, requests/s at 64
    assert [h.benchmark for h in heads] == ["frontend"] * 2, out
    assert all(h.ratio is not None and h.target and h.met is not None for h in heads), heads
