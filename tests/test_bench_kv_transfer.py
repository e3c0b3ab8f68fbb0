"""bench/kv_transfer.py runs on a tiny configuration and prints every backend beside its
baselines, with the bytes verified, and a headline per backend (figures are not judged against
the targets here)."""

from pathlib import Path

import pytest

from tests.helpers import bench_headlines, run_bench

SIZES = ("32", "100")  # 2 and 7 blocks of 16 tokens (the last one partial)
PLACEMENTS = ("scattered", "consecutive")
BASELINES = {"shm": "memcpy", "tcp": "raw socket", "nixl": "nixl raw"}
POOL_BYTES = 7 * 16 * 23_040  # both pools hold the largest prompt's blocks


def _pool_segments() -> set[str]:
    """Shared-memory segments of a pool's size (others' tests may make segments meanwhile)."""
    root = Path("/dev/shm")
    if not root.is_dir():
        return set()
    return {p.name for p in root.glob("psm_*") if p.stat().st_size == POOL_BYTES}


@pytest.mark.integration
def test_kv_transfer_bench_prints_backends_and_baselines() -> None:
    before = _pool_segments()
    out, rows = run_bench("kv_transfer.py", "--sizes", *SIZES, "--trials", "2")
    by_cell = {(r[0], r[2], r[3], r[4]): r for r in rows}
    assert len(by_cell) == len(rows)  # one row per cell

    nixl_rows = [r for r in rows if r[2] == "nixl"]
    for tokens, blocks in (("32", 2), ("100", 7)):
        mb = f"{blocks * 16 * 23_040 / 1e6:.1f}"
        assert {r[1] for r in rows if r[0] == tokens} == {mb}
        assert (tokens, "memcpy", "copy", "") in by_cell
        assert (tokens, "raw socket", "recv", "") in by_cell
        for backend in ("shm", "tcp"):
            assert {(r[3], r[4]) for r in rows if r[0] == tokens and r[2] == backend} == {
                (op, placement) for op in ("read", "write") for placement in PLACEMENTS
            }
            for op in ("read", "write"):
                scattered = by_cell[(tokens, backend, op, "scattered")]
                consecutive = by_cell[(tokens, backend, op, "consecutive")]
                assert consecutive[5] == "1"  # one piece
                assert 1 <= int(scattered[5]) <= blocks
        nixl = [r for r in nixl_rows if r[0] == tokens]
        if nixl[0][6].startswith("n/a"):  # NIXL not installed, or not working: one row says why
            assert len(nixl) == 1
        else:
            assert {(r[3], r[4]) for r in nixl} == {
                (op, placement) for op in ("read", "write") for placement in PLACEMENTS
            }
            assert (tokens, "nixl raw", "read", "consecutive") in by_cell
            assert (tokens, "nixl raw", "write", "consecutive") in by_cell

    for r in rows:
        if r[6].startswith("n/a"):
            assert r[2] == "nixl"
            continue
        ms, gbs = float(r[6].replace(",", "")), float(r[7].replace(",", ""))
        assert ms > 0 and gbs > 0
        assert r[10] == "yes"  # the bytes arrived intact
        if r[2] in BASELINES:
            assert r[8].endswith(f"x {BASELINES[r[2]]}") and float(r[8].split()[0]) > 0
            assert r[9].endswith((": met", ": MISSED"))
    assert "bytes verified intact in every measured cell: yes" in out
    heads = bench_headlines(out)  # each backend measured: its read into scattered blocks
    measured = ["shm", "tcp"] + (["nixl"] if not nixl_rows[0][6].startswith("n/a") else [])
    assert [h.benchmark for h in heads] == ["kv_transfer"] * len(measured), out
    assert [h.figure.split()[0] for h in heads] == measured
    for h in heads:
        assert "read, 100 tokens, scattered" in h.figure, h
        assert h.ratio is not None and h.target.startswith("ratio at least") and h.met is not None
    assert not _pool_segments() - before  # both pools' shared memory is gone
