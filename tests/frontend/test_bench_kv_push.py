"""bench/kv_push.py still runs end to end (one prompt, one deployment per mode, on the tiny
model): both modes pushed the prompt's KV and answered alike (the benchmark checks both), and
the figures parse and are positive, and its headline compares the modes (their size is for the
benchmark to judge)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import bench_headlines, run_bench


@pytest.mark.integration
@pytest.mark.timeout(300)  # two deployments on a busy 2-core machine
def test_kv_push_bench_compares_both_modes(chat_model: Path) -> None:
    out, rows = run_bench(
        "kv_push.py",
        "--model",
        str(chat_model),
        "--backends",
        "tcp",
        "--lengths",
        "100",
        "--prompts",
        "2",
        "--trials",
        "1",
    )
    (row,) = rows
    assert row[:2] == ["tcp", "100"]
    assert all(float(cell) > 0 for cell in row[2:]), row
    (head,) = bench_headlines(out)  # tcp's handoff wait, layers against blocks
    assert head.benchmark == "kv_push" and head.figure.startswith("tcp 100-token"), head
    assert head.ratio is not None and head.target == "" and head.met is None, head
