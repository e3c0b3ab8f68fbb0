"""What readers of `--discovery kubernetes` see: the keys of live leases whose pods are Ready.

A watcher drops a lease when, connected to the API, it has seen the lease's renewTime unchanged
for its TTL (by its own clock: no clock skew) and a fresh read confirms it: a renewal its watch
did not bring means the watch is stuck (a half-open connection), and it starts again. It then
deletes the lease's object (only if unchanged since the read). A one-off read (`get_prefix`)
can only tell by the wall clock: it skips leases renewed more than 2 TTL + 5 s ago.

Each `LeaseWatch` lists, then watches from the list's resourceVersion; a watch the server ends
is resumed; one that cannot resume (410 Gone) or breaks lists again and delivers the difference.
Once its first watch is open it lists once more: an API that does not replay the changes made
between a list and its watch (an emulator, a caching proxy) would otherwise hide a deletion
made in between until the TTL. After an outage every lease gets a fresh TTL (its owner could
not renew either), from the first list or watch event that gets through. Pods are listed and
watched once per handle (`PodReadiness`), from the first lease that names one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from kvbaton.runtime.discovery import kube_objects as ko
from kvbaton.runtime.discovery.base import Backoff, PrefixWatch, WatchEvent
from kvbaton.runtime.discovery.kube_requests import (
    KubernetesDiscoveryError,
    KubernetesUnavailableError,
    LeaseApi,
    WatchGoneError,
    event_version,
    log,
)

SKEW_S = 5.0
CHANGES = ("ADDED", "MODIFIED", "DELETED")


def renewed_lately(record: ko.LeaseRecord) -> bool:
    """By the wall clock (what a one-off read can tell)."""
    return record.renew_wall + 2 * record.ttl + SKEW_S >= time.time()


class PodReadiness:
    """Which pods of the namespace are Ready (and not terminating)."""

    def __init__(self, api: LeaseApi, on_change: Callable[[], None]) -> None:
        self.api = api
        self.on_change = on_change
        self.ready: dict[str, bool] | None = None  # None until pods are listed
        self.error: Exception | None = None  # why they could not be listed, meanwhile
        self._task: asyncio.Task[None] | None = None

    def admits(self, record: ko.LeaseRecord) -> bool:
        return not record.pod or (self.ready or {}).get(record.pod, False)

    def start(self) -> None:
        """Start listing and watching pods (once); `on_change` follows the first list."""
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name="kube-pods")

    async def ensure(self, records: dict[str, ko.LeaseRecord]) -> None:
        """From the first lease that names a pod on: know which pods are ready (waiting up to
        `connect_timeout` for the first list; then its error is raised)."""
        if self.ready is not None or not any(r.pod for r in records.values()):
            return
        self.start()
        deadline = time.monotonic() + self.api.connect_timeout
        while self.ready is None:
            if time.monotonic() > deadline:
                raise self.error or KubernetesUnavailableError("pods could not be listed")
            await asyncio.sleep(0.02)

    async def _follow(self) -> None:
        backoff = Backoff()
        while self.ready is None:  # (a refusal may be mended: RBAC applied late)
            try:
                self.ready, version = await self.api.list_pods()
            except (KubernetesUnavailableError, KubernetesDiscoveryError) as exc:
                if self.error is None:
                    log.warning("cannot list pods (keys of pods are hidden meanwhile): %s", exc)
                self.error = exc
                await asyncio.sleep(backoff.next())
        self.error = None
        self.on_change()
        backoff.reset()
        while True:
            opened = time.monotonic()
            try:
                async for event in self.api.watch_pods(version):
                    version = event_version(event) or version
                    obj = event.get("object") or {}
                    name = (obj.get("metadata") or {}).get("name")
                    if event.get("type") in CHANGES and name:
                        was = self.ready.get(name, False)
                        if event["type"] == "DELETED":
                            self.ready.pop(name, None)
                        else:
                            self.ready[name] = ko.pod_ready(obj)
                        if self.ready.get(name, False) != was:
                            self.on_change()
                if time.monotonic() - opened > 1.0:
                    backoff.reset()
                    continue  # the server ended the watch: resume
            except asyncio.CancelledError:
                raise
            except WatchGoneError:
                pass
            except Exception as exc:
                log.warning("watch of pods failed (listing them again): %s", exc)
            await asyncio.sleep(backoff.next())
            with contextlib.suppress(KubernetesUnavailableError, KubernetesDiscoveryError):
                self.ready, version = await self.api.list_pods()
                self.on_change()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def visible(
    records: dict[str, ko.LeaseRecord], pods: PodReadiness, live: Callable[[ko.LeaseRecord], bool]
) -> dict[str, bytes]:
    """The keys of live leases whose pods are ready (the newest lease wins a key)."""
    keys: dict[str, tuple[float, bytes]] = {}
    for record in records.values():
        if not live(record) or not pods.admits(record):
            continue
        for key, value in record.keys.items():
            if key not in keys or keys[key][0] < record.renew_wall:
                keys[key] = (record.renew_wall, value)
    return {k: v for k, (_, v) in keys.items()}


class LeaseWatch:
    """The keys under one prefix, as one PrefixWatch is told of them."""

    def __init__(
        self,
        api: LeaseApi,
        pods: PodReadiness,
        prefix: str,
        records: dict[str, ko.LeaseRecord],
        version: str,
    ) -> None:
        self.api, self.pods, self.prefix = api, pods, prefix
        self.queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        self.records = records
        self.observed = dict.fromkeys(records, time.monotonic())  # renewTime first seen
        self.version = version  # to resume from
        self.told: dict[str, bytes] = {}
        self.reaped: set[str] = set()  # leases confirmed expired (hidden, objects deleted)
        self.connected = True
        self.watch: PrefixWatch | None = None  # made when the first watch opens
        self.opened = asyncio.Event()  # (then)
        self.response: Any = None  # of the open watch
        self.tasks: list[asyncio.Task[None]] = []
        self._on_close: Callable[[], None] = lambda: None

    async def start(self, on_close: Callable[[], None]) -> PrefixWatch:
        """Once the first watch is open: the PrefixWatch (snapshot, then changes). A refusal
        (RBAC, a missing CRD) is raised; an API that cannot be reached is waited for up to
        `connect_timeout`."""
        self._on_close = on_close
        follow = asyncio.create_task(self._follow(), name=f"kube-watch {self.prefix}")
        self.tasks = [follow, asyncio.create_task(self._tick(), name=f"kube-ttl {self.prefix}")]
        opened = asyncio.create_task(self.opened.wait())
        await asyncio.wait(
            {follow, opened}, timeout=self.api.connect_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        opened.cancel()
        if self.watch is None:
            await self.stop()
            if follow.done() and not follow.cancelled() and follow.exception() is not None:
                raise follow.exception()  # type: ignore[misc]
            raise KubernetesUnavailableError(
                f"could not open a watch of {ko.PLURAL} at {self.api.where} within "
                f"{self.api.connect_timeout:g} s"
            )
        return self.watch

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _live(self, record: ko.LeaseRecord) -> bool:
        return record.name not in self.reaped

    def _current(self) -> dict[str, bytes]:
        keys = visible(self.records, self.pods, self._live)
        return {k: v for k, v in keys.items() if k.startswith(self.prefix)}

    def publish(self) -> None:
        """Tell the watcher what changed since it was last told."""
        if self.watch is None:
            return  # (the snapshot, when it is made, tells it all)
        current = self._current()
        for key in self.told.keys() - current.keys():
            self.queue.put_nowait(WatchEvent("delete", key, None))
        for key, value in current.items():
            if self.told.get(key) != value:
                self.queue.put_nowait(WatchEvent("put", key, value))
        self.told = current

    def _apply(self, name: str, record: ko.LeaseRecord | None) -> None:
        old = self.records.get(name)
        if record is None:
            self.records.pop(name, None)
            self.observed.pop(name, None)
            self.reaped.discard(name)
            return
        self.records[name] = record
        if old is None or old.renew != record.renew:
            self.observed[name] = time.monotonic()
            self.reaped.discard(name)  # renewed: alive after all
        if record.pod and self.pods.ready is None:
            self.pods.start()  # its readiness decides; `publish` runs once pods are known

    async def _follow(self) -> None:
        backoff = Backoff()
        while True:
            opened = time.monotonic()
            try:
                await self.pods.ensure(self.records)
                async for event in self.api.watch_leases(self.version):
                    if event["type"] == "OPEN":
                        self._reconnected()
                        self.response = event["response"]
                        if self.watch is None:  # see the module's docstring
                            await self._relist(publish=False)
                            self.told = self._current()
                            self.watch = PrefixWatch(dict(self.told), self.queue, self._on_close)
                            self.opened.set()
                        continue
                    self.version = event_version(event) or self.version
                    if event.get("type") in CHANGES:
                        obj = event.get("object") or {}
                        name = (obj.get("metadata") or {}).get("name", "")
                        record = None if event["type"] == "DELETED" else ko.parse_lease(obj)
                        self._apply(name, record)
                        self.publish()
                    self._reconnected()
                if time.monotonic() - opened > 1.0:
                    backoff.reset()
                    continue  # the server ended the watch: resume from the last version
            except asyncio.CancelledError:
                raise
            except WatchGoneError:
                log.info("watch of %s: resourceVersion too old; listing again", self.prefix)
            except KubernetesDiscoveryError as exc:
                if self.watch is None:
                    raise  # refused at the start: the caller is told
                log.warning("watch of %s failed: %s", self.prefix, exc)
                self.connected = False
            except Exception as exc:  # broken stream, unreachable API
                log.debug("watch of %s broke: %r", self.prefix, exc)
                self.connected = False
            await asyncio.sleep(backoff.next())
            await self._relist()

    async def _relist(self, publish: bool = True) -> None:
        with contextlib.suppress(KubernetesUnavailableError, KubernetesDiscoveryError):
            records, version = await self.api.list_leases()
            self._reconnected()
            for name in self.records.keys() - records.keys():
                self._apply(name, None)
            for name, record in records.items():
                self._apply(name, record)
            self.version = version
            if publish:
                self.publish()

    def _reconnected(self) -> None:
        """The API answered: after an outage every lease gets a fresh TTL (its owner could not
        renew either), whether a list or a watch is the first to get through."""
        if not self.connected:
            self.observed = dict.fromkeys(self.records, time.monotonic())
            self.connected = True

    async def _tick(self) -> None:
        """Confirm and reap the leases whose renewals stopped."""
        while True:
            ttl = min((r.ttl for r in self.records.values()), default=1.0)
            await asyncio.sleep(max(0.05, min(0.5, ttl / 8)))
            now = time.monotonic()
            due = [
                r
                for r in self.records.values()
                if r.name not in self.reaped and self.observed.get(r.name, now) + r.ttl < now
            ]
            if due and self.connected and self.watch is not None:
                await self._confirm(due)

    async def _confirm(self, due: list[ko.LeaseRecord]) -> None:
        try:
            listed, _ = await self.api.list_leases(retry=False)
        except (KubernetesUnavailableError, KubernetesDiscoveryError):
            self.connected = False  # an outage: keep what is known
            return
        if any(r.name in listed and listed[r.name].renew != r.renew for r in due):
            log.warning("the watch of %s missed renewals; watching again", self.prefix)
            if self.response is not None:
                self.response.close()
        for record in due:
            current = listed.get(record.name)
            self._apply(record.name, current)
            if current is not None and current.renew == record.renew:
                log.info("lease %s expired (no renewal for %g s)", record.name, record.ttl)
                self.reaped.add(record.name)
                with contextlib.suppress(KubernetesUnavailableError, KubernetesDiscoveryError):
                    await self.api.delete(record.name, current.version)
        self.publish()
