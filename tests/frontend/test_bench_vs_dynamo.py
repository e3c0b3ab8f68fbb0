"""bench/vs_dynamo.py still runs end to end on kvbaton's side (Dynamo is not installed where the
tests run) and prints its table with every process's CPU (figures are not judged here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_bench


@pytest.mark.integration
def test_vs_dynamo_bench_runs_kvbatons_side(chat_model: Path) -> None:
    _, rows = run_bench(
        "vs_dynamo.py",
        "--stacks",
        "kvbaton",
        "--model",
        str(chat_model),
        "--concurrency",
        "1,4",
        "--requests",
        "8",
        "--requests-at-1",
        "3",
        "--isl",
        "32",
        "--osl",
        "8",
    )
    assert [(row[1], row[2]) for row in rows] == [("1", "kvbaton"), ("4", "kvbaton")]
    for row in rows:
        assert float(row[3]) > 0 and float(row[4]) > 0  # requests/s, TTFT p50 ms
        assert "frontend" in row[7] and "worker" in row[7]  # CPU by process
