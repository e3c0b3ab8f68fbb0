"""A worker's KV pool in shared memory: its pages are allocated when it is made, and a pool that
/dev/shm has no room for lives in private memory instead (peers then reach it over TCP only)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from kvbaton.kv_transfer import pool as pool_module
from kvbaton.kv_transfer.pool import KvPool

NBYTES = 64 * 2**20

needs_fallocate = pytest.mark.skipif(
    not hasattr(os, "posix_fallocate") or not Path("/dev/shm").is_dir(),
    reason="posix_fallocate on /dev/shm is Linux's",
)


@needs_fallocate
def test_the_segment_s_pages_are_allocated_when_the_pool_is_made() -> None:
    pool = KvPool(shared=True)
    try:
        buffer = pool.allocate(NBYTES)
        assert pool.segment is not None and len(buffer) == NBYTES
        allocated = os.stat(f"/dev/shm/{pool.segment.name}").st_blocks * 512
        assert allocated >= NBYTES  # not a sparse file whose pages come on first touch
        assert bytes(buffer[:16]) == bytes(16) and bytes(buffer[-16:]) == bytes(16)
    finally:
        pool.close()


@needs_fallocate
def test_no_room_in_dev_shm_gives_a_private_pool_and_leaves_no_segment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    made: list[str] = []

    def full(segment: object, nbytes: int) -> None:
        made.append(segment.name)  # type: ignore[attr-defined]
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pool_module, "_reserve", full)
    pool = KvPool(shared=True)
    with caplog.at_level(logging.WARNING, logger="kvbaton.kv_transfer.pool"):
        buffer = pool.allocate(NBYTES)
    assert not pool.shared and pool.segment is None and len(buffer) == NBYTES
    assert "no room for a 0.06 GiB KV pool in /dev/shm (No space left on device)" in caplog.text
    assert made and not Path(f"/dev/shm/{made[0].lstrip('/')}").exists()
    assert pool.info().shm_name == ""  # peers are not told of a segment
    buffer[:4] = b"kvkv"  # private memory, writable
    pool.close()
