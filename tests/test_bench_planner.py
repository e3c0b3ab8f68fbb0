"""bench/planner.py runs on a very short trace: the table has its three configurations and no
request was lost, the planner's scale-downs included (figures are not judged here)."""

import pytest

from tests.helpers import run_bench

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
