"""The disk tier: blocks' KV as files under a directory that the workers of a host share.

Files: `<root>/<store key, hex>/<hash, hex[:2]>/<hash, 16 hex digits>.kvb` (`block_file.py`).
- A file appears whole or not at all: it is written under `<root>/tmp/` first, then renamed.
  A process killed mid-write leaves only a temporary file; the next tier opened on the root
  removes it once its writer is gone.
- A read verifies the file; one that fails (truncated, flipped, foreign) is removed: a miss.
- LRU by modification time, across every process on the root: a read touches its file; a write
  that takes the root over `capacity_bytes` removes the oldest files (of any store) down to
  nine tenths of it.
- A full disk (ENOSPC, EDQUOT), or a capacity below one block, turns writing off for this
  process, with one warning; reads go on.
- `on_change(stored, removed)` hears of the blocks of its store that this process added (a new
  file) or removed (LRU, a rejected file); `store` names the store across processes and hosts.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

from kvbaton.kv_tiers import block_file

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskTier:
    def __init__(
        self,
        root: Path,
        store_key: bytes,
        kv_bytes: int,
        capacity_bytes: int,
        on_change: Callable[[list[int], list[int]], None] | None = None,
    ) -> None:
        self.root = root
        self.store_key = store_key
        self.kv_bytes = kv_bytes
        self.file_bytes = block_file.HEADER_BYTES + kv_bytes
        self.capacity_bytes = capacity_bytes
        self.dir = root / store_key.hex()
        self.tmp = root / "tmp"
        self.on_change = on_change
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store = f"{socket.gethostname()}:{self.dir.resolve()}"
        self.tmp.mkdir(exist_ok=True)
        self._names = itertools.count()
        self.writable = True
        self.rejected = 0  # files that failed verification (removed)
        self.removed = 0  # files removed to stay within capacity
        self._remove_orphans()
        self.num_files, self.num_bytes = self._usage()  # as of the last scan, plus own writes
        if self.file_bytes > capacity_bytes:
            self._stop_writing(f"{capacity_bytes} bytes hold no block of {self.file_bytes}")

    def path(self, block_hash: int) -> Path:
        name = f"{block_hash:016x}"
        return self.dir / name[:2] / f"{name}{SUFFIX}"

    def contains(self, block_hash: int) -> bool:
        return self.path(block_hash).exists()

    def read(self, block_hash: int) -> memoryview | None:
        """The block's KV if its file is there and whole (then the most recently used)."""
        path = self.path(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        kv = block_file.decode(data, self.store_key, block_hash, self.kv_bytes)
        if kv is None:
            log.warning("KV tier: %s is not a whole block; removed", path)
            self.rejected += 1
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self._changed([], [block_hash])
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)
        return kv

    def write(self, block_hash: int, kv: bytes | memoryview) -> bool:
        """Store the block (or touch it if stored); False if not stored."""
        if not self.writable:
            return False
        path = self.path(block_hash)
        try:
            os.utime(path)
            return True
        except FileNotFoundError:
            pass
        tmp = self.tmp / f"{os.getpid()}-{next(self._names)}.tmp"
        try:
            with tmp.open("xb") as f:
                f.write(block_file.encode_header(self.store_key, block_hash, kv))
                f.write(kv)
            path.parent.mkdir(exist_ok=True)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if e.errno in _FULL:
                self._stop_writing(e.strerror or str(e))
            else:
                log.warning("KV tier: writing %s failed: %s", path, e)
            return False
        self.num_files += 1
        self.num_bytes += self.file_bytes
        self._changed([block_hash], [])
        if self.num_bytes > self.capacity_bytes:
            self._remove_oldest()
        return True

    def hashes(self) -> list[int]:
        """The blocks of its store, as the directory lists them now."""
        return [int(p.stem, 16) for p in self.dir.glob(f"*/*{SUFFIX}")]

    # -- internals ---------------------------------------------------------------------------
    def _stop_writing(self, why: str) -> None:
        if self.writable:
            log.warning("KV tier: the disk tier at %s stops taking blocks (%s)", self.root, why)
        self.writable = False

    def _files(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every stored block on the root."""
        found = []
        for path in self.root.glob(f"*/*/*{SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                st = path.stat()
                found.append((st.st_mtime, st.st_size, path))
        return found

    def _usage(self) -> tuple[int, int]:
        files = self._files()
        return len(files), sum(size for _, size, _ in files)

    def _remove_oldest(self) -> None:
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        target = self.capacity_bytes * 9 // 10
        kept = len(files)
        removed = []
        for _, size, path in files:
            if total <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                self.removed += 1
                if path.parent.parent == self.dir:
                    removed.append(int(path.stem, 16))
            total -= size
            kept -= 1
        self.num_files, self.num_bytes = kept, total
        self._changed([], removed)

    def _changed(self, stored: list[int], removed: list[int]) -> None:
        if self.on_change is not None and (stored or removed):
            self.on_change(stored, removed)

    def _remove_orphans(self) -> None:
        """Temporary files whose writer is gone."""
        for tmp in self.tmp.glob("*.tmp"):
            writer = tmp.name.split("-", 1)[0]
            pid = int(writer) if writer.isdigit() else 0
            if pid == os.getpid() or _alive(pid):
                continue
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # no signal: asks whether it exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
