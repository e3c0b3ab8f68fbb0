"""The host-memory tier: blocks' KV in this process's memory.

- At most `capacity_bytes` held; the least recently used block goes first.
- Safe to call from any thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class HostTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, block_hash: int, kv: bytes) -> list[int]:
        """Keep `kv` (if it fits at all), evicting the least recently used blocks: their
        hashes."""
        if len(kv) > self.capacity_bytes:
            return []
        evicted = []
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            self._bytes -= len(old) if old is not None else 0
            while self._blocks and self._bytes + len(kv) > self.capacity_bytes:
                h, gone = self._blocks.popitem(last=False)
                self._bytes -= len(gone)
                evicted.append(h)
            self._blocks[block_hash] = kv
            self._bytes += len(kv)
        return evicted

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._blocks)

    def get(self, block_hash: int) -> bytes | None:
        """The block's KV (now the most recently used), or None."""
        with self._lock:
            kv = self._blocks.get(block_hash)
            if kv is not None:
                self._blocks.move_to_end(block_hash)
            return kv

    def clear(self) -> list[int]:
        """Drop every block; their hashes."""
        with self._lock:
            gone = list(self._blocks)
            self._blocks.clear()
            self._bytes = 0
        return gone
