"""A worker's KV pool as the transfer layer sees it: `num_blocks` blocks of `block_bytes` bytes,
block i at offset i * block_bytes of one buffer (the engine lays each block out contiguous
across all layers, so a block is one piece; within it, layer l's K and V are the `block_bytes //
num_layers` bytes from l * that, so a run of layers of a block is one piece too). The buffer
lives in a shared-memory segment when peers on this host may reach it there.

Invariants:
- The segment is created by the pool's owner, which alone unlinks it (`close`, or its resource
  tracker if the process dies); peers only attach (`attach_segment`).
- A pool made with `pin` (a GPU's host mirror) pins its buffer where CUDA allows, and unpins it
  on `close`, before the segment is unmapped."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

from kvbaton.kv_transfer import host_pin
from kvbaton.protocols.llm import KvPoolInfo

log = logging.getLogger(__name__)

_OWNED: set[str] = set()  # segments this process created


class _Segment(shared_memory.SharedMemory):
    """A segment that may be let go of while views of it live (the engine's cache, freed after
    the modules at exit): its mapping then stays until the last view goes, instead of
    `SharedMemory.__del__` raising BufferError."""

    def __del__(self) -> None:
        with contextlib.suppress(BufferError):
            super().__del__()


def _reserve(segment: shared_memory.SharedMemory, nbytes: int) -> None:
    """Allocate the segment's pages now (OSError if the file system has no room for them): a
    page first touched when /dev/shm is full would kill the process with SIGBUS instead."""
    fd = getattr(segment, "_fd", -1)
    if fd >= 0 and hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, nbytes)


@functools.cache
def host_id() -> str:
    """This machine: its name and boot id (two hosts may share a name)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return socket.gethostname() + (":" + boot.read_text().strip() if boot.is_file() else "")


class KvPool:
    """Call `attach(buffer, ...)` once the engine laid its cache over the buffer."""

    def __init__(self, shared: bool = True, pin: bool = False) -> None:
        self.shared = shared
        self.pin = pin
        self.pinned: memoryview | None = None  # the buffer, while pinned
        self.segment: shared_memory.SharedMemory | None = None
        self.blocks: np.ndarray | None = None  # uint8 [num_blocks, block_bytes]
        self.layout = ""
        self.num_blocks = 0
        self.block_bytes = 0
        self.num_layers = 1

    def allocate(self, nbytes: int) -> memoryview:
        """The buffer for the engine's cache (zeroed): in shared memory if `shared` and the
        shared-memory file system has room for all of it, its pages allocated at once."""
        buffer = self._shared_buffer(nbytes) if self.shared and nbytes > 0 else None
        if buffer is None:
            buffer = memoryview(bytearray(nbytes))
        if self.pin and host_pin.pin(buffer):
            self.pinned = buffer
        return buffer

    def _shared_buffer(self, nbytes: int) -> memoryview | None:
        segment = _Segment(create=True, size=nbytes)
        _OWNED.add(segment.name)
        try:
            _reserve(segment, nbytes)
        except OSError as e:
            segment.close()
            segment.unlink()
            _OWNED.discard(segment.name)
            log.warning(
                "no room for a %.2f GiB KV pool in /dev/shm (%s): peers reach it over TCP only",
                nbytes / 2**30,
                e.strerror or e,
            )
            self.shared = False
            return None
        self.segment = segment
        buffer = segment.buf
        assert buffer is not None
        return buffer[:nbytes]

    def attach(
        self,
        buffer: memoryview | None,
        layout: str,
        num_blocks: int,
        block_bytes: int,
        num_layers: int = 1,
    ) -> None:
        """The engine's cache: `buffer` (None when its KV is not in host memory, or has none)."""
        if num_layers < 1 or block_bytes % num_layers:
            raise ValueError("a block holds a whole number of bytes per layer")
        self.layout, self.num_blocks, self.block_bytes = layout, num_blocks, block_bytes
        self.num_layers = num_layers
        if buffer is not None and block_bytes:
            self.blocks = np.frombuffer(buffer, dtype=np.uint8, count=num_blocks * block_bytes)
            self.blocks = self.blocks.reshape(num_blocks, block_bytes)

    def info(self, tcp_address: str = "", nixl_metadata: bytes = b"") -> KvPoolInfo:
        return KvPoolInfo(
            layout=self.layout,
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            host=host_id(),
            shm_name=self.segment.name if self.segment is not None else "",
            tcp_address=tcp_address,
            nixl_metadata=nixl_metadata,
        )

    def byte_span(self, layers: tuple[int, int] | None) -> tuple[int, int]:
        """(offset, length) within each block of layers [first, end); None: the whole block."""
        if layers is None:
            return 0, self.block_bytes
        first, end = layers
        if not 0 <= first < end <= self.num_layers:
            raise ValueError(f"layers must be a range within [0, {self.num_layers})")
        per_layer = self.block_bytes // self.num_layers
        return first * per_layer, (end - first) * per_layer

    def check_blocks(self, block_ids: list[int]) -> None:
        if any(b < 0 or b >= self.num_blocks for b in block_ids):
            raise ValueError(f"block ids must be in [0, {self.num_blocks})")

    def close(self) -> None:
        self.blocks = None
        if self.pinned is not None:
            pinned, self.pinned = self.pinned, None
            host_pin.unpin(pinned)
        if self.segment is not None:
            segment, self.segment = self.segment, None
            with contextlib.suppress(BufferError):  # the engine's cache still views it
                segment.close()
            segment.unlink()
            _OWNED.discard(segment.name)


def attach_segment(name: str, nbytes: int) -> tuple[shared_memory.SharedMemory, np.ndarray]:
    """A peer's segment and a uint8 view of its first `nbytes` bytes. Attaching does not make
    this process an owner: its resource tracker is told to leave the segment alone."""
    segment = _Segment(name=name)
    # Trackers differ between Python versions; a failure here only warns at exit. (A segment
    # of this process's own stays registered: its owner unlinks it.)
    if name not in _OWNED:
        with contextlib.suppress(Exception):
            resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    if segment.size < nbytes:
        segment.close()
        raise ValueError(f"shared memory {name!r} is smaller than its pool")
    buffer = segment.buf
    assert buffer is not None
    return segment, np.frombuffer(buffer, dtype=np.uint8, count=nbytes)


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both ids advance by one together: a
    run is one copy."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            first_s, first_d, n = runs[-1]
            runs[-1] = (first_s, first_d, n + 1)
        else:
            runs.append((s, d, 1))
    return runs
