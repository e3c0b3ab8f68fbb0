"""bench/run_all.py runs the benchmarks it is given and tabulates their headlines; a benchmark
that cannot run is a row that says why, not a missing row."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import pytest

from tests.helpers import BENCH_DIR, bench_headlines, table_rows


def run_all_module() -> ModuleType:
    sys.path.insert(0, str(BENCH_DIR))
    try:
        return importlib.import_module("run_all")
    finally:
        sys.path.remove(str(BENCH_DIR))


@pytest.mark.unit
def test_a_benchmark_that_cannot_run_is_a_row_saying_why() -> None:
    run_all = run_all_module()
    bench = run_all.Benchmark("vllm_front", (), python=".venv-none/bin/python")
    outcome = run_all.run_one(bench, quick=True, out_dir=None)
    assert outcome.failure == "no .venv-none/bin/python" and not outcome.headlines
    row = run_all.table([outcome], quick=True).splitlines()[-1]
    assert row.startswith("| `vllm_front` | `python bench/vllm_front.py` | not measured: no .venv")


@pytest.mark.unit
def test_every_benchmark_listed_exists_and_each_runs_once() -> None:
    names = [b.name for b in run_all_module().BENCHMARKS]
    assert len(names) == len(set(names))
    assert all((BENCH_DIR / f"{name}.py").is_file() for name in names)


@pytest.mark.integration
def test_quick_run_tabulates_the_headlines_at_this_commit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_all = run_all_module()
    # One benchmark, as briefly as it runs (its figures are not what is checked here).
    brief = run_all.Benchmark("request_plane", ("--duration", "0.2", "--trials", "1"))
    monkeypatch.setattr(run_all, "BENCHMARKS", (brief,))
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--quick", "--only", "request_plane"])
    with pytest.raises(SystemExit) as exited:
        run_all.main()
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert exited.value.code == 0, out
    assert "Commit: " in out and "Mode: quick" in out
    assert rows and all(row[0] == "`request_plane`" for row in rows)
    assert all(row[6] in {"met", "**missed**", "—"} for row in rows)
    assert not bench_headlines(out)  # the table, not the benchmark's raw lines
