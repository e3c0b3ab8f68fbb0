"""The tiers below an engine's pool: host memory, then disk (docs/architecture.md, "KV tiers").

- `offload` (engine thread) copies each evicted block's KV once: the host tier keeps it; for the
  disk tier it waits in memory for a writer thread of its own, readable there until written.
- At most `max_waiting_bytes` wait for the writer; blocks beyond that are dropped (not written).
- `load` (a load thread) reads each block from the host tier, the waiting writes, then disk. A
  block missing or rejected fails the whole load: the engine computes the prompt from its
  pool's hits on, so a bad block costs time, never tokens.
- `close` lets the writer finish what waits, for at most `CLOSE_TIMEOUT_S`.
- KV events of tier host and disk say what each tier gained and lost, in the engine's stream:
  a block offloaded to memory, one written to disk (not before: a router must not count a
  block that no other worker can read yet), ones removed by either LRU or rejected.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvbaton.engine.connector import EmitEvent, KvCacheView, KvLoad, KvLoadFailed
from kvbaton.kv_tiers.disk import DiskTier
from kvbaton.kv_tiers.host import HostTier
from kvbaton.kv_tiers.store_key import store_key
from kvbaton.protocols.kv import DISK, HOST, BlockRemoved, BlockStored, KvDump
from kvbaton.protocols.llm import KvTierStats

log = logging.getLogger(__name__)

MAX_WAITING_BYTES = 256 * 2**20
DEFAULT_DISK_BYTES = 10 * 2**30
CLOSE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class TierSettings:
    """What a worker's flags ask for: `--kv-offload-gib`, `--kv-disk-dir`, `--kv-disk-gib`."""

    host_bytes: int = 0
    disk_dir: Path | None = None
    disk_bytes: int = DEFAULT_DISK_BYTES

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_dir is not None

    def for_model(self, model_dir: Path) -> Callable[[KvCacheView, EmitEvent], KvTiers]:
        """The tiers of an engine on `model_dir`, given its cache and its event stream."""

        def build(view: KvCacheView, emit: EmitEvent) -> KvTiers:
            host = HostTier(self.host_bytes) if self.host_bytes > 0 else None
            disk = None
            if self.disk_dir is not None:
                key = store_key(model_dir, view.layout)
                disk = DiskTier(self.disk_dir, key, view.block_bytes, self.disk_bytes)
            return KvTiers(view, host, disk, emit)

        return build


class KvTiers:
    def __init__(
        self,
        view: KvCacheView,
        host: HostTier | None,
        disk: DiskTier | None,
        emit: EmitEvent | None = None,
        max_waiting_bytes: int = MAX_WAITING_BYTES,
    ) -> None:
        if view.buffer is None or view.block_bytes == 0:
            raise ValueError("KV tiers need a cache whose blocks have bytes in host memory")
        self.view = view
        self._emit = emit
        if disk is not None:
            disk.on_change = self._disk_changed
        self.buffer = view.buffer
        self.host = host
        self.disk = disk
        self.max_waiting_bytes = max_waiting_bytes
        self._waiting: dict[int, bytes] = {}  # for the disk writer, by hash
        self._waiting_bytes = 0
        self._lock = threading.Lock()
        self._stats = KvTierStats(
            host_capacity_bytes=host.capacity_bytes if host else 0,
            disk_capacity_bytes=disk.capacity_bytes if disk else 0,
        )
        self._writes: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        if disk is not None:
            self._writer = threading.Thread(
                target=self._write_loop, name="kvbaton-kv-tier-writer", daemon=True
            )
            self._writer.start()

    # -- the engine's thread -----------------------------------------------------------------
    def lookup(self, block_hashes: list[int]) -> int:
        found = 0
        for h in block_hashes:
            if not (
                (self.host is not None and h in self.host)
                or h in self._waiting
                or (self.disk is not None and self.disk.contains(h))
            ):
                break
            found += 1
        return found

    def offload(self, blocks: list[tuple[int, int]]) -> None:
        self.view.stage_out([block for _, block in blocks])
        size = self.view.block_bytes
        kept: list[int] = []
        evicted: list[int] = []
        for h, block in blocks:
            if self.host is not None and self.host.get(h) is not None:
                continue  # kept already (and on disk, or dropped, since)
            kv = bytes(self.buffer[block * size : (block + 1) * size])
            self._stats.offloaded_blocks += 1
            if self.host is not None:
                evicted += self.host.put(h, kv)
                kept.append(h)
            if self.disk is None:
                continue
            with self._lock:
                if h in self._waiting:
                    continue
                if self._waiting_bytes + size > self.max_waiting_bytes or not self.disk.writable:
                    self._stats.dropped_blocks += 1
                    continue
                self._waiting[h] = kv
                self._waiting_bytes += size
            self._writes.put(h)
        self._report(HOST, kept, evicted)  # in this order: a block kept, then evicted, is gone

    def forget(self) -> None:
        if self.host is not None:
            self._report(HOST, [], self.host.clear())

    def fill_dump(self, dump: KvDump) -> None:
        if self.host is not None:
            dump.host_block_hashes = self.host.hashes()
        if self.disk is not None:
            dump.store = self.disk.store
            dump.store_block_hashes = self.disk.hashes()

    def _disk_changed(self, stored: list[int], removed: list[int]) -> None:
        self._report(DISK, stored, removed)

    def _report(self, tier: str, stored: list[int], removed: list[int]) -> None:
        """KV events of `tier`: blocks it gained, then blocks it lost."""
        if self._emit is None:
            return
        store = self.disk.store if tier == DISK and self.disk is not None else None
        if stored:
            self._emit(
                lambda i: BlockStored(
                    event_id=i,
                    block_hashes=stored,
                    parent_hash=None,
                    token_ids=[],
                    block_size=0,
                    tier=tier,
                    store=store,
                )
            )
        if removed:
            self._emit(
                lambda i: BlockRemoved(event_id=i, block_hashes=removed, tier=tier, store=store)
            )

    def stats(self) -> KvTierStats:
        s = self._stats
        if self.host is not None:
            s.host_blocks, s.host_bytes = self.host.num_blocks, self.host.num_bytes
        if self.disk is not None:
            s.disk_blocks, s.disk_bytes = self.disk.num_files, self.disk.num_bytes
            s.disk_writable = self.disk.writable
            s.rejected_blocks = self.disk.rejected
        with self._lock:
            return msgspec.structs.replace(s)  # a copy: load threads go on counting

    # -- a load thread -----------------------------------------------------------------------
    def load(self, load: KvLoad) -> list[int]:
        start = time.monotonic()
        size = self.view.block_bytes
        from_host = from_disk = 0
        for h, block in zip(load.block_hashes, load.dst_blocks, strict=True):
            kv: bytes | memoryview | None = self.host.get(h) if self.host is not None else None
            if kv is None:
                with self._lock:
                    kv = self._waiting.get(h)
            if kv is not None:
                from_host += 1
            elif self.disk is not None and (kv := self.disk.read(h)) is not None:
                from_disk += 1
            else:
                with self._lock:
                    self._stats.load_failures += 1
                raise KvLoadFailed(f"block {h:016x} left the KV tiers")
            self.buffer[block * size : (block + 1) * size] = kv
        self.view.stage_in(load.dst_blocks)
        with self._lock:
            s = self._stats
            s.loads += 1
            s.hit_blocks_host += from_host
            s.hit_blocks_disk += from_disk
            s.load_seconds += time.monotonic() - start
        return []

    # -- the writer thread -------------------------------------------------------------------
    def _write_loop(self) -> None:
        assert self.disk is not None
        while (h := self._writes.get()) is not None:
            with self._lock:
                kv = self._waiting[h]
            written = self.disk.write(h, kv)
            with self._lock:
                del self._waiting[h]
                self._waiting_bytes -= len(kv)
                if written:
                    self._stats.written_blocks += 1
                else:
                    self._stats.dropped_blocks += 1

    def close(self) -> None:
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(CLOSE_TIMEOUT_S)
            if self._writer.is_alive():
                log.warning("KV tier: %d blocks were not written in time", len(self._waiting))
