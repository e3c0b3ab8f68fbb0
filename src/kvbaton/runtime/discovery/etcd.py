"""etcd discovery (`etcd://host:port[,host:port...][/key-prefix]`), over aetcd (grpc.aio).

Leases. Each `grant_lease` grants an etcd lease (TTL rounded up to whole seconds; etcd raises a
TTL below its own minimum, 1.5 election timeouts, i.e. 2 s with etcd's default settings, and the
TTL it grants is the one kept) and a task keeps it alive every TTL/3. The id handed out is a
logical id: the first etcd lease's id, kept for the life of the handle. Every key put under it
is remembered; when etcd says the lease is gone (it expired during an outage, or someone revoked
it), a new etcd lease is granted and every remembered key is put again under it, while callers
(and the key names they built from the id) keep the logical id.

Outages. Only the first contact must succeed (a `grant_lease` that cannot reach etcd within
`connect_timeout` raises `EtcdUnavailableError`). Afterwards a put or delete of our own keys
that cannot reach etcd is remembered and applied when etcd returns; keep-alives and watches
retry with exponential backoff (capped at 2 s), and the outage is logged once. Reads
(`get_prefix`, the snapshot of `watch_prefix`) wait at most `connect_timeout` and then raise.

Watches. A snapshot (a range read and its revision), then one watch stream per `PrefixWatch`
from the snapshot's revision + 1. When the stream breaks it is opened again from the last
delivered revision + 1; if that revision was compacted (or the store went back in time), the
prefix is read again and the difference against what the watcher knew is delivered. While etcd
is down a watcher keeps what it has.

With a key prefix in the URL, every key is stored under it and read back without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlparse

import aetcd
from aetcd import rpc
from aetcd.utils import prefix_range_end

from kvbaton.runtime.discovery.base import (
    BACKOFF_MIN_S,
    Backoff,
    Discovery,
    PrefixWatch,
    WatchEvent,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PORT = 2379
CONNECT_TIMEOUT_S = 5.0  # first contact, reads: then a clear error
OP_TIMEOUT_S = 5.0  # any single call to etcd
CLOSE_TIMEOUT_S = 2.0  # revoking leases on close when etcd may be gone
_CHANNEL_OPTIONS = {
    # Reconnect promptly once etcd is back (grpc's default backoff grows to 120 s).
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 2000,
    # Find a dead connection under an idle watch (etcd allows pings every 5 s and more).
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.max_pings_without_data": 0,
}


class EtcdUnavailableError(ConnectionError):
    """etcd could not be reached (within the bounded wait, where there is one)."""


class EtcdError(RuntimeError):
    """etcd answered with an error."""


class _LeaseLost(Exception):
    """etcd no longer knows the lease a key was put under."""


class _Resync(Exception):
    """A watch cannot resume from its revision: read the prefix again."""


def _describe(exc: BaseException) -> str:
    """One line for a log or an error: grpc's own errors are many lines long."""
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def _lease_not_found(exc: BaseException) -> bool:
    return "lease not found" in str(exc)


@dataclass(eq=False)
class _Lease:
    logical_id: int
    ttl: int
    etcd_id: int | None  # None: to be granted (lost, or granted while etcd was down)
    keys: dict[str, bytes] = field(default_factory=dict)  # what we own: key -> value
    dirty: set[str] = field(default_factory=set)  # keys whose etcd state may differ from `keys`
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


@dataclass(eq=False)
class _Watch:
    prefix: str  # the caller's prefix (without our root)
    queue: asyncio.Queue[WatchEvent]
    known: dict[str, bytes]  # what the watcher was told
    revision: int  # the last revision it was told of
    task: asyncio.Task[None] | None = None


class EtcdDiscovery(Discovery):
    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        root: str = "",
        *,
        connect_timeout: float = CONNECT_TIMEOUT_S,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd discovery needs at least one endpoint")
        self.url = "etcd://" + ",".join(f"{h}:{p}" for h, p in endpoints) + root
        self.root = root.rstrip("/")
        self.connect_timeout = connect_timeout
        self._clients = [
            aetcd.Client(host, port, timeout=OP_TIMEOUT_S, options=_CHANNEL_OPTIONS)
            for host, port in endpoints
        ]
        self._current = 0
        self._leases: dict[int, _Lease] = {}
        self._watches: weakref.WeakSet[PrefixWatch] = weakref.WeakSet()
        self._watch_states: set[_Watch] = set()
        self._reached = False  # etcd answered once: outages are tolerated from then on
        self._online = True
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, connect_timeout: float = CONNECT_TIMEOUT_S) -> EtcdDiscovery:
        parsed = urlparse(url)
        if parsed.scheme != "etcd" or not parsed.netloc:
            raise ValueError(f"etcd discovery URL {url!r} is not etcd://host:port[,...][/prefix]")
        endpoints = []
        for part in parsed.netloc.split(","):
            host, sep, port = part.rpartition(":")
            if not sep or not port.isdigit():  # no port (or an IPv6 address without one)
                host, port = part, str(DEFAULT_PORT)
            endpoints.append((host, int(port)))
        return cls(endpoints, parsed.path, connect_timeout=connect_timeout)

    # -- plumbing ----------------------------------------------------------------------------
    @property
    def _client(self) -> Any:
        return self._clients[self._current]

    def _offline(self, exc: BaseException) -> None:
        """A call failed for want of etcd: log once per outage (before the first contact the
        caller raises instead), try the next endpoint."""
        if self._online and self._reached:
            log.warning(
                "etcd at %s is unreachable (%s); serving with what is known, retrying",
                self.url,
                _describe(exc),
            )
        self._online = False
        self._current = (self._current + 1) % len(self._clients)

    def _reachable(self) -> None:
        if not self._online:
            log.warning("etcd at %s is reachable again", self.url)
        self._online = self._reached = True

    async def _call(self, fn: Callable[[Any], Awaitable[T]], timeout: float = OP_TIMEOUT_S) -> T:
        """One call on the current endpoint, bounded; marks etcd reachable or not. Raises
        `EtcdUnavailableError` or `EtcdError`, never aetcd's own errors."""
        try:
            async with asyncio.timeout(timeout):
                result = await fn(self._client)
        except (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, TimeoutError) as exc:
            self._offline(exc)
            raise EtcdUnavailableError(f"etcd at {self.url}: {_describe(exc)}") from exc
        except aetcd.ClientError as exc:
            raise EtcdError(f"etcd at {self.url}: {_describe(exc)}") from exc
        self._reachable()
        return result

    async def _call_bounded(self, fn: Callable[[Any], Awaitable[T]], what: str) -> T:
        """Retry `fn` with backoff for up to `connect_timeout`, then raise a clear error."""
        deadline = time.monotonic() + self.connect_timeout
        backoff = Backoff()
        while True:
            left = deadline - time.monotonic()
            try:
                return await self._call(fn, max(0.05, min(OP_TIMEOUT_S, left)))
            except EtcdUnavailableError as exc:
                if time.monotonic() + BACKOFF_MIN_S >= deadline:
                    raise EtcdUnavailableError(
                        f"etcd at {self.url} is unreachable (could not {what} within "
                        f"{self.connect_timeout:g} s): {_describe(exc.__cause__ or exc)}"
                    ) from exc
            await asyncio.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))

    def _full(self, key: str) -> bytes:
        return (self.root + key).encode()

    def _range(self, prefix: str) -> tuple[bytes, bytes]:
        full = self._full(prefix)
        return (full, prefix_range_end(full)) if full else (b"\0", b"\0")

    def _strip(self, key: bytes) -> str:
        return key.decode(errors="replace")[len(self.root) :]

    # -- leases ------------------------------------------------------------------------------
    async def grant_lease(self, ttl: float) -> int:
        seconds = max(1, math.ceil(ttl))
        try:
            if self._reached and not self._online:
                raise EtcdUnavailableError(f"etcd at {self.url} is unreachable")
            granted = await self._call_bounded(lambda c: c.lease(seconds), "grant a lease")
            lease = _Lease(granted.id, max(1, int(granted.ttl)), granted.id)
        except EtcdUnavailableError:
            if not self._reached:
                raise
            # etcd answered before: hand out a logical id now, grant when etcd is back.
            log.warning(
                "lease granted while etcd at %s is unreachable; registering later", self.url
            )
            lease = _Lease(secrets.randbits(62) | 1 << 62, seconds, None)
        self._leases[lease.logical_id] = lease
        lease.task = asyncio.create_task(
            self._keepalive_loop(lease), name=f"etcd-keepalive-{lease.logical_id:x}"
        )
        return lease.logical_id

    async def revoke_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None and lease.task is not None:
            lease.task.cancel()
            await asyncio.gather(lease.task, return_exceptions=True)
        etcd_id = lease_id if lease is None else lease.etcd_id
        if etcd_id is None:
            return
        try:
            await self._call(lambda c: c.revoke_lease(etcd_id))
        except (EtcdError, EtcdUnavailableError) as exc:
            if lease is not None and not _lease_not_found(exc):
                log.warning("could not revoke lease %x (its keys expire with it): %s", etcd_id, exc)

    async def _keepalive_loop(self, lease: _Lease) -> None:
        """Keep the etcd lease alive; grant a new one and re-put every key when it is lost; put
        or delete keys that could not be written before. Retries with backoff while etcd is
        unreachable."""
        backoff = Backoff()
        due = 0.0  # when the next keep-alive is due
        while True:
            try:
                async with lease.lock:
                    if lease.etcd_id is not None and time.monotonic() >= due:
                        reply = await self._call(
                            lambda c: c.refresh_lease(lease.etcd_id),
                            max(1.0, min(OP_TIMEOUT_S, lease.ttl / 3)),
                        )
                        if reply is None:
                            raise EtcdUnavailableError(f"etcd at {self.url} did not answer")
                        if reply.TTL <= 0:
                            log.warning(
                                "etcd lost lease %x; re-registering its %d keys",
                                lease.logical_id,
                                len(lease.keys),
                            )
                            lease.etcd_id = None
                        due = time.monotonic() + lease.ttl / 3
                    if lease.etcd_id is None:
                        granted = await self._call(lambda c: c.lease(lease.ttl))
                        lease.etcd_id, lease.dirty = granted.id, set(lease.keys)
                        due = time.monotonic() + max(1, int(granted.ttl)) / 3
                    await self._flush(lease)
                backoff.reset()
                wait = max(0.0, due - time.monotonic())
            except asyncio.CancelledError:
                raise
            except _LeaseLost:
                wait = 0.0
            except Exception as exc:  # unreachable or failing: retry, never give up
                if not isinstance(exc, EtcdUnavailableError):
                    log.warning("etcd keep-alive of lease %x failed: %s", lease.logical_id, exc)
                due, wait = 0.0, backoff.next()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await lease.wake.wait()
            lease.wake.clear()

    async def _flush(self, lease: _Lease) -> None:
        """Bring etcd in line with `lease.keys` for the dirty keys (the caller holds the lock).
        Raises `_LeaseLost` (and forgets the etcd lease) when etcd no longer has it."""
        etcd_id = lease.etcd_id
        for key in sorted(lease.dirty):
            value = lease.keys.get(key)
            try:
                await self._call(self._write_op(key, value, etcd_id))
            except EtcdError as exc:
                if value is not None and _lease_not_found(exc):
                    lease.etcd_id = None
                    raise _LeaseLost from exc
                if lease.keys.get(key) is value:  # (not changed meanwhile: then it is dirty)
                    lease.dirty.discard(key)  # refused, not unreachable: trying again won't help
                    lease.keys.pop(key, None)
                raise
            if lease.keys.get(key) is value:  # a put or delete meanwhile leaves it dirty
                lease.dirty.discard(key)

    def _write_op(
        self, key: str, value: bytes | None, etcd_id: int | None
    ) -> Callable[[Any], Awaitable[Any]]:
        full = self._full(key)
        if value is None:
            return lambda c: c.delete(full)
        return lambda c: c.put(full, value, etcd_id)

    async def _write(self, lease: _Lease, key: str) -> None:
        """Apply a change now if etcd is there; else leave it to the keep-alive loop."""
        if lease.etcd_id is not None and self._online:
            try:
                async with lease.lock:
                    await self._flush(lease)
                return
            except (_LeaseLost, EtcdUnavailableError):
                pass
        log.warning(
            "%s goes to etcd at %s later (etcd unreachable or the lease being granted again)",
            key,
            self.url,
        )
        lease.wake.set()

    # -- keys --------------------------------------------------------------------------------
    async def put(self, key: str, value: bytes, lease_id: int) -> None:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise KeyError(f"lease {lease_id:x} is not held by this process")
        for other in self._leases.values():
            if other is not lease and other.keys.pop(key, None) is not None:
                other.dirty.discard(key)
        lease.keys[key] = value
        lease.dirty.add(key)
        await self._write(lease, key)

    async def delete(self, key: str) -> None:
        owner = next((lease for lease in self._leases.values() if key in lease.keys), None)
        if owner is not None:
            del owner.keys[key]
            owner.dirty.add(key)
            await self._write(owner, key)
        else:
            await self._call_bounded(lambda c: c.delete(self._full(key)), f"delete {key}")

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return (await self._read(prefix))[0]

    async def _read(self, prefix: str) -> tuple[dict[str, bytes], int]:
        start, end = self._range(prefix)
        result = await self._call_bounded(lambda c: c.get_range(start, end), f"read {prefix}")
        return {self._strip(kv.key): kv.value for kv in result.kvs}, int(result.header.revision)

    # -- watches -----------------------------------------------------------------------------
    async def watch_prefix(self, prefix: str) -> PrefixWatch:
        snapshot, revision = await self._read(prefix)
        state = _Watch(prefix, asyncio.Queue(), dict(snapshot), revision)
        state.task = asyncio.create_task(self._follow(state), name=f"etcd-watch {prefix}")
        self._watch_states.add(state)
        watch = PrefixWatch(snapshot, state.queue, lambda: self._unwatch(state))
        self._watches.add(watch)
        return watch

    def _unwatch(self, state: _Watch) -> None:
        self._watch_states.discard(state)
        if state.task is not None:
            state.task.cancel()

    async def _follow(self, state: _Watch) -> None:
        backoff = Backoff()
        while True:
            try:
                await self._watch_once(state, backoff)
            except asyncio.CancelledError:
                raise
            except _Resync as exc:
                log.info("watch of %s reads the prefix again: %s", state.prefix, exc)
                with contextlib.suppress(EtcdUnavailableError, EtcdError):
                    self._resync(state, *await self._read(state.prefix))
                    continue
            except (rpc.AioRpcError, ConnectionError, TimeoutError) as exc:
                self._offline(exc)  # resume from the last revision when etcd is back
            except Exception as exc:
                log.warning("watch of %s failed, resuming: %r", state.prefix, exc)
            await asyncio.sleep(backoff.next())

    async def _watch_once(self, state: _Watch, backoff: Backoff) -> None:
        """Run one watch stream from `state.revision + 1` until it breaks (always raises)."""
        start, end = self._range(state.prefix)
        create = rpc.WatchRequest(
            create_request=rpc.WatchCreateRequest(
                key=start, range_end=end, start_revision=state.revision + 1, progress_notify=True
            )
        )
        hold = asyncio.Event()  # keeps our side of the stream open until the call ends

        async def requests() -> AsyncIterator[Any]:
            yield create
            await hold.wait()

        client = self._client
        await client.connect()
        call = rpc.WatchStub(client.channel).Watch(requests(), metadata=client.metadata)
        try:
            async with asyncio.timeout(OP_TIMEOUT_S) as until_created:
                async for response in call:
                    if response.compact_revision:
                        raise _Resync(f"revision {state.revision + 1} was compacted")
                    if response.canceled:
                        raise ConnectionError(f"etcd canceled the watch: {response.cancel_reason}")
                    if response.created:
                        if response.header.revision < state.revision:
                            raise _Resync("etcd's revision went back (a new cluster?)")
                        until_created.reschedule(None)
                        self._reachable()
                        backoff.reset()
                    for event in response.events:
                        key = self._strip(event.kv.key)
                        if event.type == rpc.Event.DELETE:
                            state.known.pop(key, None)
                            state.queue.put_nowait(WatchEvent("delete", key, None))
                        else:
                            state.known[key] = event.kv.value
                            state.queue.put_nowait(WatchEvent("put", key, event.kv.value))
                        state.revision = max(state.revision, event.kv.mod_revision)
        finally:
            hold.set()
            call.cancel()
        raise ConnectionError("the watch stream ended")

    def _resync(self, state: _Watch, current: dict[str, bytes], revision: int) -> None:
        """Deliver the difference between what the watcher knew and `current`."""
        for key in state.known.keys() - current.keys():
            state.queue.put_nowait(WatchEvent("delete", key, None))
        for key, value in current.items():
            if state.known.get(key) != value:
                state.queue.put_nowait(WatchEvent("put", key, value))
        state.known, state.revision = dict(current), revision

    # -- closing -----------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop watches and keep-alives, revoke our leases (bounded), close the channels."""
        if self._closed:
            return
        self._closed = True
        tasks = [s.task for s in self._watch_states if s.task is not None]
        for watch in list(self._watches):
            watch.close()
        self._watches.clear()
        self._watch_states.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await asyncio.gather(
                    *(self.revoke_lease(lid) for lid in list(self._leases)),
                    return_exceptions=True,
                )
        tasks = [lease.task for lease in self._leases.values() if lease.task is not None]
        self._leases.clear()  # the revokes ran out of time: the keys expire with the leases
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in self._clients:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await client.close()
