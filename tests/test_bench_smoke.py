"""The benchmarks still run and print their comparison and headlines (figures are not judged
here)."""

from pathlib import Path

import pytest

from tests.helpers import bench_headlines, run_bench
from tests.tiny_models import build_chat_model


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


@pytest.mark.integration
def test_step_breakdown_splits_a_step_into_projections_and_the_rest(tmp_path: Path) -> None:
    model = build_chat_model(tmp_path / "tiny")
    out, rows = run_bench("step_breakdown.py", "--model", str(model), "--trials", "1")
    step, projections, rest = (float(row[1]) for row in rows)
    assert [row[0].split()[0] for row in rows] == ["whole", "projections", "the"], out
    assert step > 0 and projections > 0
    assert rest == pytest.approx(step - projections, abs=0.02)
    (head,) = bench_headlines(out)  # the projections' streaming rate beside the summing loop's
    assert head.benchmark == "step_breakdown" and head.ratio is not None and head.ratio > 0
    assert head.figure.startswith("projections stream") and head.met is None


@pytest.mark.integration
def test_overload_bench_prints_shedding_beside_the_baseline(tmp_path: Path) -> None:
    model = build_chat_model(tmp_path / "tiny")
    out, rows = run_bench("overload.py", "--model", str(model), "--seconds", "2", "--overload", "4")
    assert [row[0] for row in rows] == ["shedding", "baseline (no shedding)"], out
    offered = 2 * 4 * 5
    for row in rows:
        assert int(row[1]) + int(row[2]) == offered  # served + refused
    assert int(rows[0][2]) > 0 and int(rows[1][2]) == 0  # only shedding refuses
    (head,) = bench_headlines(out)
    assert head.benchmark == "overload" and head.ratio is not None and head.met is None
