"""bench/startup.py still runs and prints its comparison (figures are not judged here): every
system answers once per trial from a cold launch, and the headline stands beside HF's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import bench_headlines, run_bench

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_startup_bench_times_each_system_to_its_first_answer(
    chat_model: Path, tmp_path: Path
) -> None:
    out, rows = run_bench(
        "startup.py", "--model", str(chat_model), "--trials", "1",
        "--vllm-python", str(tmp_path / "no-vllm" / "python"),
    )  # fmt: skip
    assert [row[0] for row in rows] == [
        "kvbaton serve",
        "kvbaton serve --engine mocker",
        "HF transformers",
    ]
    assert all(float(row[1]) > 0 for row in rows)
    (head,) = bench_headlines(out)
    assert head.benchmark == "startup" and "HF transformers" in head.baseline
    assert head.ratio is not None and head.ratio > 0 and head.target == "" and head.met is None
