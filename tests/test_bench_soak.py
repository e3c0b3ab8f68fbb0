"""bench/soak.py runs on a very short soak: a row per window, no failed request, the drift
and memory lines, and the headlines: no failure (met), the RSS slope not judged on so short a
run, the latency drift (figures are not judged here)."""

import pytest

from tests.helpers import bench_headlines, run_bench


@pytest.mark.integration
@pytest.mark.slow
def test_soak_bench_runs_and_fails_no_request() -> None:
    out, rows = run_bench(
        "soak.py", "--minutes", "0.3", "--window-s", "6", "--calibrate-s", "4", "--workers", "1"
    )
    assert len(rows) == 3, out
    for row in rows:
        assert int(row[1]) > 0 and int(row[2]) == 0, out  # requests, none failed
        assert float(row[7]) > 0 and float(row[8]) > 0  # RSS of the frontend and the worker
    assert "drift (last window over the first): TTFT p99 x" in out
    assert "memory growth after the first window: frontend" in out
    failed, memory, drift = bench_headlines(out)
    assert {h.benchmark for h in (failed, memory, drift)} == {"soak"}
    assert failed.target == "0 failed" and failed.met is True, out
    assert "not judged" in memory.target and memory.met is None
    assert drift.ratio is not None
