"""bench/planner.py runs on a very short trace: the table has its three configurations, no
request was lost, the planner's scale-downs included, and it prints its three headlines against
the peak-sized deployment; bench/planner_replay.py prints every seed and variant (figures are
not judged here)."""

import pytest

from tests.helpers import bench_headlines, run_bench

CONFIGS = ("fixed-1P1D", "fixed-peak", "planner")


@pytest.mark.integration
@pytest.mark.slow
def test_planner_bench_runs_three_configurations_and_loses_nothing() -> None:
    out, rows = run_bench(
        "planner.py", "--duration", "12", "--speedup-ratio", "0.1", "--interval", "2"
    )
    by_config = {row[0]: row for row in rows}
    assert tuple(by_config) == CONFIGS, out
    for config, row in by_config.items():
        sent, completed, lost = int(row[2]), int(row[3]), int(row[4])
        assert sent > 0, config
        assert completed == sent and lost == 0, f"{config} lost requests:\n{out}"
        assert 0.0 <= float(row[5].rstrip("%")) <= 100.0
        assert float(row[10]) > 0  # worker-seconds
    assert by_config["fixed-1P1D"][1] == "1P+1D"
    assert "planner vs fixed-peak:" in out
    goodput, worker_seconds, lost = bench_headlines(out)
    assert {h.benchmark for h in (goodput, worker_seconds, lost)} == {"planner"}
    assert worker_seconds.ratio is not None and worker_seconds.met is not None
    assert lost.target == "0 lost" and lost.met is True, out
    assert goodput.met is not None


@pytest.mark.integration
def test_planner_replay_prints_every_seed_and_variant_and_the_sums() -> None:
    out, rows = run_bench(
        "planner_replay.py", "--seeds", "2", "--variants", "level-shift:2,constant:1"
    )
    assert [(row[0], row[1]) for row in rows] == [
        (seed, variant)
        for seed in ("0", "1")
        for variant in ("level-shift, patience 2", "constant, patience 1")
    ]
    for row in rows:
        assert float(row[2]) >= 2 * 180  # at least 1P+1D all along
        assert float(row[3]) >= 0 and int(row[5]) <= int(row[4])  # never below 1P+1D
    assert "- level-shift, patience 2: " in out and "(100.0%)" in out
    assert "- constant, patience 1: " in out
