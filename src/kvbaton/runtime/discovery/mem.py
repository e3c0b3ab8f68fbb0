"""In-process discovery: every runtime of one process that names the same store sees the same
keys. Leases never expire on their own (the keep-alive is the process being alive)."""

from __future__ import annotations

import asyncio
import itertools
import weakref

from kvbaton.runtime.discovery.base import Discovery, PrefixWatch, WatchEvent


class MemStore:
    """The shared state behind `MemDiscovery` handles of one name."""

    def __init__(self) -> None:
        self.keys: dict[str, tuple[bytes, int]] = {}
        self.leases: dict[int, set[str]] = {}
        self.watchers: list[tuple[str, asyncio.Queue[WatchEvent]]] = []
        self.lease_ids = itertools.count(0x1000)

    def notify(self, event: WatchEvent) -> None:
        for prefix, queue in self.watchers:
            if event.key.startswith(prefix):
                queue.put_nowait(event)

    def drop_key(self, key: str) -> None:
        entry = self.keys.pop(key, None)
        if entry is not None:
            self.leases.get(entry[1], set()).discard(key)
            self.notify(WatchEvent("delete", key, None))


_STORES: dict[str, MemStore] = {}


class MemDiscovery(Discovery):
    def __init__(self, name: str = "default") -> None:
        self._store = _STORES.setdefault(name, MemStore())
        self._own_leases: set[int] = set()
        self._watches: weakref.WeakSet[PrefixWatch] = weakref.WeakSet()

    async def grant_lease(self, ttl: float) -> int:
        lease_id = next(self._store.lease_ids)
        self._store.leases[lease_id] = set()
        self._own_leases.add(lease_id)
        return lease_id

    async def revoke_lease(self, lease_id: int) -> None:
        self._own_leases.discard(lease_id)
        for key in sorted(self._store.leases.pop(lease_id, set())):
            self._store.drop_key(key)

    async def put(self, key: str, value: bytes, lease_id: int) -> None:
        if lease_id not in self._store.leases:
            raise KeyError(f"lease {lease_id:x} does not exist")
        old = self._store.keys.get(key)
        if old is not None and old[1] != lease_id:
            self._store.leases.get(old[1], set()).discard(key)
        self._store.keys[key] = (value, lease_id)
        self._store.leases[lease_id].add(key)
        self._store.notify(WatchEvent("put", key, value))

    async def delete(self, key: str) -> None:
        self._store.drop_key(key)

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return {k: v for k, (v, _) in self._store.keys.items() if k.startswith(prefix)}

    async def watch_prefix(self, prefix: str) -> PrefixWatch:
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        entry = (prefix, queue)
        self._store.watchers.append(entry)
        watch = PrefixWatch(
            await self.get_prefix(prefix), queue, lambda: self._store.watchers.remove(entry)
        )
        self._watches.add(watch)
        return watch

    async def close(self) -> None:
        for watch in list(self._watches):
            watch.close()
        self._watches.clear()
        for lease_id in list(self._own_leases):
            await self.revoke_lease(lease_id)
