"""File discovery: a directory shared by the processes of one machine, one file per key.

Layout under the root:
- `.leases/{lease:x}`: a lease; its modification time is the last keep-alive.
- the key's own path (`/services/ns/comp/ep-1a2b` -> `root/services/ns/comp/ep-1a2b`): the value
  and the id of the lease that owns it.

A key is live while its file exists and its lease file was touched within the lease's TTL. No
process has to be alive to expire a key: every reader judges liveness from modification times, and
removes the files of expired leases it finds (best effort; a process that is still alive rewrites
its files on its next keep-alive). Watchers rescan on file-system events (inotify through
watchfiles' notify binding), at the earliest lease expiry they know of, and at a slow fallback tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import threading
import time
import weakref
from pathlib import Path

import msgspec

from kvbaton.runtime.discovery.base import Discovery, PrefixWatch, WatchEvent

log = logging.getLogger(__name__)

_LEASES = ".leases"
_FALLBACK_TICK_S = 2.0


class _KeyRecord(msgspec.Struct, array_like=True):
    lease_id: int
    value: bytes


class _LeaseRecord(msgspec.Struct, array_like=True):
    ttl: float
    pid: int


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class FileDiscovery(Discovery):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()
        self._lease_dir = self.root / _LEASES
        self._lease_dir.mkdir(parents=True, exist_ok=True)
        self._own: dict[int, tuple[float, dict[str, bytes]]] = {}  # lease -> (ttl, keys)
        self._keepalive_task: asyncio.Task[None] | None = None
        self._watchers: list[tuple[str, asyncio.Queue[WatchEvent]]] = []
        self._watches: weakref.WeakSet[PrefixWatch] = weakref.WeakSet()
        self._snapshot: dict[str, bytes] = {}
        self._next_expiry = float("inf")
        self._dirty = asyncio.Event()
        self._scanner_task: asyncio.Task[None] | None = None
        self._fs_thread: threading.Thread | None = None
        self._fs_stop = threading.Event()

    # -- paths -------------------------------------------------------------------------------
    def _key_path(self, key: str) -> Path:
        parts = key.split("/")
        if (
            not key.startswith("/")
            or any(p in ("", ".", "..") for p in parts[1:])
            or any(p.startswith(".") for p in parts[1:])
        ):
            raise ValueError(f"invalid discovery key {key!r}")
        return self.root.joinpath(*parts[1:])

    def _lease_path(self, lease_id: int) -> Path:
        return self._lease_dir / f"{lease_id:x}"

    # -- leases ------------------------------------------------------------------------------
    async def grant_lease(self, ttl: float) -> int:
        lease_id = secrets.randbits(62) | 1 << 62
        self._own[lease_id] = (ttl, {})
        _write_atomic(
            self._lease_path(lease_id), msgspec.msgpack.encode(_LeaseRecord(ttl, os.getpid()))
        )
        if self._keepalive_task is None or self._keepalive_task.done():
            self._keepalive_task = asyncio.create_task(
                self._keepalive_loop(), name="file-keepalive"
            )
        return lease_id

    async def revoke_lease(self, lease_id: int) -> None:
        _ttl, keys = self._own.pop(lease_id, (0.0, {}))
        for key in keys:
            _unlink(self._key_path(key))
        _unlink(self._lease_path(lease_id))
        self._dirty.set()

    async def _keepalive_loop(self) -> None:
        while self._own:
            interval = min(ttl for ttl, _ in self._own.values()) / 4
            await asyncio.sleep(interval)
            for lease_id, (ttl, keys) in list(self._own.items()):
                try:
                    self._keep_alive(lease_id, ttl, keys)
                except OSError as exc:  # keep trying: a full disk may recover
                    log.warning("file discovery keep-alive of lease %x failed: %s", lease_id, exc)
        self._keepalive_task = None

    def _keep_alive(self, lease_id: int, ttl: float, keys: dict[str, bytes]) -> None:
        path = self._lease_path(lease_id)
        try:
            os.utime(path)
        except FileNotFoundError:  # expired and reaped while we stalled: come back
            log.warning("lease %x was expired by a peer; re-registering its keys", lease_id)
            _write_atomic(path, msgspec.msgpack.encode(_LeaseRecord(ttl, os.getpid())))
        for key, value in keys.items():
            key_path = self._key_path(key)
            if not key_path.exists():
                _write_atomic(key_path, msgspec.msgpack.encode(_KeyRecord(lease_id, value)))
                self._dirty.set()

    # -- keys --------------------------------------------------------------------------------
    async def put(self, key: str, value: bytes, lease_id: int) -> None:
        if lease_id not in self._own:
            raise KeyError(f"lease {lease_id:x} is not held by this process")
        _write_atomic(self._key_path(key), msgspec.msgpack.encode(_KeyRecord(lease_id, value)))
        for other, (_, keys) in self._own.items():
            if other != lease_id:
                keys.pop(key, None)
        self._own[lease_id][1][key] = value
        self._dirty.set()

    async def delete(self, key: str) -> None:
        _unlink(self._key_path(key))
        for _, keys in self._own.values():
            keys.pop(key, None)
        self._dirty.set()

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return {k: v for k, v in self._scan().items() if k.startswith(prefix)}

    def _scan(self) -> dict[str, bytes]:
        """Every live key; removes the files of expired leases; sets `_next_expiry`."""
        now = time.time()
        leases: dict[int, bool] = {}  # lease -> alive; absent: no lease file (reaped or revoked)
        unreadable: set[int] = set()
        next_expiry = float("inf")
        for entry in os.scandir(self._lease_dir):
            if entry.name.startswith("."):
                continue
            try:
                lease_id = int(entry.name, 16)
            except ValueError:
                continue
            try:
                expiry = (
                    entry.stat().st_mtime
                    + msgspec.msgpack.decode(Path(entry.path).read_bytes(), type=_LeaseRecord).ttl
                )
            except (OSError, msgspec.DecodeError):
                unreadable.add(lease_id)  # vanishing or foreign: judged at the next scan
                continue
            alive = expiry > now
            leases[lease_id] = alive
            if alive:
                next_expiry = min(next_expiry, expiry)
            else:
                _unlink(Path(entry.path))
        live: dict[str, bytes] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if name.startswith("."):
                    continue
                path = Path(dirpath, name)
                try:
                    record = msgspec.msgpack.decode(path.read_bytes(), type=_KeyRecord)
                except (OSError, msgspec.DecodeError):
                    continue
                if leases.get(record.lease_id):
                    live["/" + path.relative_to(self.root).as_posix()] = record.value
                elif (
                    record.lease_id not in self._own
                    and record.lease_id not in unreadable
                    and not self._lease_alive(record.lease_id, now)
                ):
                    _unlink(path)  # re-checked: a lease granted after the listing is alive
        self._next_expiry = next_expiry
        return live

    def _lease_alive(self, lease_id: int, now: float) -> bool:
        path = self._lease_path(lease_id)
        try:
            ttl = msgspec.msgpack.decode(path.read_bytes(), type=_LeaseRecord).ttl
            return path.stat().st_mtime + ttl > now
        except (OSError, msgspec.DecodeError):
            return False

    # -- watches -----------------------------------------------------------------------------
    def _rescan_and_notify(self) -> None:
        current = self._scan()
        previous, self._snapshot = self._snapshot, current
        events = [WatchEvent("delete", k, None) for k in previous.keys() - current.keys()]
        events += [WatchEvent("put", k, v) for k, v in current.items() if previous.get(k) != v]
        for event in events:
            for prefix, queue in self._watchers:
                if event.key.startswith(prefix):
                    queue.put_nowait(event)

    async def _scanner_loop(self) -> None:
        while self._watchers:
            timeout = min(_FALLBACK_TICK_S, max(0.0, self._next_expiry - time.time()) + 0.01)
            with contextlib.suppress(TimeoutError):  # (not wait_for: see router/kv_events.py)
                async with asyncio.timeout(timeout):
                    await self._dirty.wait()
            self._dirty.clear()
            try:
                self._rescan_and_notify()
            except OSError as exc:  # e.g. the directory was removed: recreate, keep watching
                log.error("file discovery scan of %s failed: %s", self.root, exc)
                with contextlib.suppress(OSError):
                    self._lease_dir.mkdir(parents=True, exist_ok=True)

    def _start_fs_events(self) -> None:
        """Watch the tree for changes (inotify where the OS has it) from a thread of our own;
        the watch is in place when this returns, so a scan after it misses no change."""
        if self._fs_thread is not None:
            return
        try:
            from watchfiles._rust_notify import RustNotify

            notify = RustNotify([str(self.root)], False, False, 50, True, True)
        except Exception as exc:  # no file-system events here: the ticks find every change
            log.info("file discovery falls back to polling (%s)", exc)
            return
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def run() -> None:
            try:
                while not stop.is_set():
                    result = notify.watch(50, 50, 500, stop)  # wakes 20 times a second, not 200
                    if isinstance(result, set) and result:
                        loop.call_soon_threadsafe(self._dirty.set)
            except RuntimeError:  # the loop closed under us
                pass
            finally:
                notify.close()

        self._fs_stop = stop
        self._fs_thread = threading.Thread(target=run, name="kvbaton-file-discovery", daemon=True)
        self._fs_thread.start()

    def _stop_fs_events(self) -> None:
        if self._fs_thread is not None:
            self._fs_stop.set()
            self._fs_thread = None

    async def watch_prefix(self, prefix: str) -> PrefixWatch:
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        self._start_fs_events()
        self._rescan_and_notify()
        snapshot = {k: v for k, v in self._snapshot.items() if k.startswith(prefix)}
        entry = (prefix, queue)
        self._watchers.append(entry)
        if self._scanner_task is None or self._scanner_task.done():
            self._scanner_task = asyncio.create_task(self._scanner_loop(), name="file-scanner")
        watch = PrefixWatch(snapshot, queue, lambda: self._unwatch(entry))
        self._watches.add(watch)
        return watch

    def _unwatch(self, entry: tuple[str, asyncio.Queue[WatchEvent]]) -> None:
        self._watchers.remove(entry)
        if not self._watchers:
            if self._scanner_task is not None:
                self._scanner_task.cancel()
                self._scanner_task = None
            self._stop_fs_events()

    async def close(self) -> None:
        for watch in list(self._watches):
            watch.close()
        self._watches.clear()
        for lease_id in list(self._own):
            await self.revoke_lease(lease_id)
        self._stop_fs_events()
        tasks = [t for t in (self._keepalive_task, self._scanner_task) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._keepalive_task = self._scanner_task = None
