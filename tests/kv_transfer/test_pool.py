"""A worker's KV pool in shared memory: its pages are allocated when it is made, a pool that
/dev/shm has no room for lives in private memory instead (peers then reach it over TCP only),
and a pool closed while the engine's cache still views it stays mapped for the view."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
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


# The engine's objects hold its cache in reference cycles, freed only after the modules at exit
# (gc disabled here makes that certain): the segment object goes before the cache's last view.
CLOSED_WHILE_VIEWED = """
import gc
import torch
from kvbaton.kv_transfer.pool import KvPool

gc.disable()
pool = KvPool(shared=True)
buffer = pool.allocate(1 << 20)
pool.attach(buffer, "x", 4, 1 << 18)
class Engine: pass
engine = Engine()
engine.cache = torch.frombuffer(buffer, dtype=torch.uint8)
engine.cycle = engine
name = pool.segment.name
del buffer
pool.close()
del pool
engine.cache.fill_(7)
print(name, int(engine.cache.sum()))
"""


@needs_fallocate
def test_a_pool_closed_while_viewed_stays_mapped_and_exits_quietly() -> None:
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CLOSED_WHILE_VIEWED)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    name, total = run.stdout.split()
    assert int(total) == 7 << 20  # every byte of the view still mapped, and written
    assert run.stderr == ""  # no "Exception ignored ... BufferError" at exit
    assert not Path(f"/dev/shm/{name}").exists()  # unlinked by close


class FakeCudart:
    """CUDA's runtime as `host_pin` calls it: registrations by address, a refusal if told."""

    def __init__(self, pool: KvPool, refuse: bool = False) -> None:
        self.pool, self.refuse = pool, refuse
        self.registered: dict[int, int] = {}
        self.mapped_at_unregister: list[bool] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        if self.refuse:
            return 2  # cudaErrorMemoryAllocation
        self.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.mapped_at_unregister.append(self.pool.segment is not None)
        return 0 if self.registered.pop(address, None) is not None else 1


def fake_cuda(monkeypatch: pytest.MonkeyPatch, cudart: FakeCudart) -> None:
    import torch

    def check_error(result: int) -> None:  # as torch's, whose CudaError needs a real CUDA
        if result:
            raise RuntimeError(f"CUDA error {result}")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "check_error", check_error)


@needs_fallocate
def test_a_pinned_pool_registers_its_buffer_and_unregisters_it_before_unmapping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = KvPool(shared=True, pin=True)
    cudart = FakeCudart(pool)
    fake_cuda(monkeypatch, cudart)
    buffer = pool.allocate(NBYTES)
    assert pool.pinned is buffer and list(cudart.registered.values()) == [NBYTES]
    pool.close()
    assert pool.pinned is None and cudart.registered == {}
    assert cudart.mapped_at_unregister == [True]


def test_a_pool_that_cuda_refuses_to_pin_works_unpinned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pool = KvPool(shared=False, pin=True)
    cudart = FakeCudart(pool, refuse=True)
    fake_cuda(monkeypatch, cudart)
    with caplog.at_level(logging.WARNING, logger="kvbaton.kv_transfer.host_pin"):
        buffer = pool.allocate(NBYTES)
    assert pool.pinned is None and len(buffer) == NBYTES
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    buffer[:4] = b"kvkv"
    pool.close()
    assert cudart.mapped_at_unregister == []  # nothing to undo


def test_without_cuda_a_pool_asked_to_pin_pins_nothing() -> None:
    pool = KvPool(shared=False, pin=True)
    assert len(pool.allocate(NBYTES)) == NBYTES and pool.pinned is None
    pool.close()
