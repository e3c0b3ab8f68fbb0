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

    def put(self, block_hash: int, kv: bytes) -> None:
        """Keep `kv` (if it fits at all), evicting the least recently used blocks."""
        if len(kv) > self.capacity_bytes:
            return
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            self._bytes -= len(old) if old is not None else 0
            while self._blocks and self._bytes + len(kv) > self.capacity_bytes:
                _, evicted = self._blocks.popitem(last=False)
                self._bytes -= len(evicted)
            self._blocks[block_hash] = kv
            self._bytes += len(kv)

    def get(self, block_hash: int) -> bytes | None:
        """The block's KV (now the most recently used), or None."""
        with self._lock:
            kv = self._blocks.get(block_hash)
            if kv is not None:
                self._blocks.move_to_end(block_hash)
            return kv

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bytes = 0
