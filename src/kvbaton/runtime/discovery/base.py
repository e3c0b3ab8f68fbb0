"""The discovery interface: a key-value store in which every key is owned by a lease.

Invariants every backend keeps:
- A key written with `put(key, value, lease_id)` lives as long as its lease. A lease lives while
  its owner keeps it alive (backends do so in the background from `grant_lease` on) and at most
  `ttl` seconds after the last keep-alive; then every key it owns vanishes for every reader.
- `watch_prefix` returns the keys present now and, with no gap between the two, the later
  changes as `WatchEvent`s, in order, until the watch is closed. A key replaced by a new value
  is a `put`. A backend that polls (file) may fold changes that come and go between two looks
  into none: watchers always converge on the current state.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable
from typing import Literal, NamedTuple


class WatchEvent(NamedTuple):
    kind: Literal["put", "delete"]
    key: str
    value: bytes | None  # None for a delete


BACKOFF_MIN_S, BACKOFF_MAX_S = 0.05, 2.0


class Backoff:
    """Exponential retry delays for a backend whose server is away: 0.05 s doubling to 2 s."""

    def __init__(self) -> None:
        self.delay = BACKOFF_MIN_S

    def reset(self) -> None:
        self.delay = BACKOFF_MIN_S

    def next(self) -> float:
        delay, self.delay = self.delay, min(self.delay * 2, BACKOFF_MAX_S)
        return delay


_CLOSED = WatchEvent("delete", "", None)  # the end-of-watch marker, compared by identity


class PrefixWatch:
    """The keys under a prefix at the time of the call, then their changes as an async iterator.

    Close it (`aclose`) to stop the delivery of events."""

    def __init__(
        self,
        snapshot: dict[str, bytes],
        queue: asyncio.Queue[WatchEvent],
        on_close: Callable[[], None],
    ) -> None:
        self.snapshot = snapshot
        self._queue = queue
        self._on_close: Callable[[], None] | None = on_close

    def __aiter__(self) -> PrefixWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        if self._on_close is None:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event is _CLOSED:
            raise StopAsyncIteration
        return event

    def close(self) -> None:
        """Stop delivery; a reader waiting in `async for` ends its loop."""
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()
            self._queue.put_nowait(_CLOSED)

    async def aclose(self) -> None:
        self.close()


class Discovery(abc.ABC):
    """Lease-owned keys with prefix reads and prefix watches."""

    @abc.abstractmethod
    async def grant_lease(self, ttl: float) -> int:
        """A new lease, kept alive in the background until revoked or until `close()`."""

    @abc.abstractmethod
    async def revoke_lease(self, lease_id: int) -> None:
        """End the lease now; its keys vanish at once. Revoking an unknown lease is a no-op."""

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, lease_id: int) -> None: ...

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove a key; removing a missing key is a no-op."""

    @abc.abstractmethod
    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every live key starting with `prefix`, with its value."""

    @abc.abstractmethod
    async def watch_prefix(self, prefix: str) -> PrefixWatch: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop keep-alives and watches. Leases are revoked, so keys vanish at once."""
