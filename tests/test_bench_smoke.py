"""The benchmarks still run and print their comparison and headlines (figures are not judged
here)."""

import pytest

from tests.helpers import bench_headlines, run_bench


@pytest.mark.integration
def test_request_plane_bench_prints_every_plane_and_the_baseline() -> None:
    out, rows = run_bench("request_plane.py", "--duration", "0.2", "--trials", "1")
    cells = {(r[0], r[1], r[2]) for r in rows}
    assert cells == {
        (mode, c, system)
        for mode in ("unary", "streaming")
        for c in ("1", "64")
        for system in ("tcp", "nats", "http", "baseline")
    }
    for row in rows:
        assert float(row[4].replace(",", "")) > 0  # responses/s
    heads = bench_headlines(out)  # tcp against the baseline at concurrency 64: unary, streaming
    assert [h.benchmark for h in heads] == ["request_plane"] * 2, out
    assert [h.figure.split()[:3] for h in heads] == [
        ["unary", "c64", "tcp"],
        ["streaming", "c64", "tcp"],
    ]
    assert all(h.ratio is not None and h.target and h.met is not None for h in heads), heads
