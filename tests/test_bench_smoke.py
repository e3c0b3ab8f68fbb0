"""The benchmarks still run and print their comparison (figures are not judged here)."""

import pytest

from tests.helpers import run_bench


@pytest.mark.integration
def test_request_plane_bench_prints_every_plane_and_the_baseline() -> None:
    _, rows = run_bench("request_plane.py", "--duration", "0.2", "--trials", "1")
    cells = {(r[0], r[1], r[2]) for r in rows}
    assert cells == {
        (mode, c, system)
        for mode in ("unary", "streaming")
        for c in ("1", "64")
        for system in ("tcp", "nats", "http", "baseline")
    }
    for row in rows:
        assert float(row[4].replace(",", "")) > 0  # responses/s
