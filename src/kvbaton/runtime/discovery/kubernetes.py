"""Kubernetes discovery (`kubernetes`, `kubernetes://NAMESPACE[?api=URL]`): no etcd, the API
server holds the keys, in KvbatonLease objects (kube_objects.py).

Where. The namespace is the URL's, else this pod's ($POD_NAMESPACE or the service account's),
else `default`. The API server is `api=` when given, else as `kube_api` finds it (KUBECONFIG, the
in-cluster service account, ~/.kube/config). In a pod, $POD_NAME and $POD_UID (the Downward
API) name the pod that owns the leases.

Leases. `grant_lease` creates the lease's object (the first contact: it fails with
`KubernetesUnavailableError` when the API cannot be reached within `connect_timeout`). A task
rewrites `spec.renewTime` every TTL/3 and brings the object in line with the keys put and
deleted (merge patches); when the object is gone (a reader reaped it, someone deleted it) it is
created again with every key, under the same lease id. While the API is unreachable, writes are
remembered and applied when it returns. `revoke_lease` and `close` delete the objects.

Readers. A key is visible while its lease is live and its pod (if it names one) is Ready and
not terminating. A lease is expired when a watcher connected to the API has seen its renewTime
unchanged for its TTL (its own clock: no clock skew), or when its renewTime is more than
2 TTL + 5 s old by the reader's wall clock (what a one-off read can tell). Watchers delete the
objects of expired leases.

Watches. Each `PrefixWatch` lists the leases and then watches them from the list's
resourceVersion; a watch the server ends is resumed from the last resourceVersion; a watch
that cannot resume (410 Gone, as a status or an ERROR event) or breaks lists again and delivers
the difference. Once its first watch is open, a PrefixWatch lists once more: an API that does
not replay the changes made between a list and its watch (an emulator, a caching proxy) would
otherwise hide a deletion made in between until the lease's TTL. Pods are listed and watched
once per handle, from the first lease that names one. After an outage every lease gets a fresh
TTL (its owner could not renew either).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlparse

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from kvbaton.runtime.discovery import kube_objects as ko
from kvbaton.runtime.discovery.base import Backoff, Discovery, PrefixWatch, WatchEvent
from kvbaton.runtime.kube_api import KubeConfigError, api_configuration, own_namespace

log = logging.getLogger(__name__)

T = TypeVar("T")

CONNECT_TIMEOUT_S = 5.0  # first contact and reads: then a clear error
REQUEST_TIMEOUT_S = 5.0  # any single request
WATCH_SERVER_TIMEOUT_S = 240  # the API server ends a watch after this; it is resumed
WATCH_SILENCE_S = 300.0  # a watch silent for longer (bookmarks come every minute) is dead
CLOSE_TIMEOUT_S = 2.0
SKEW_S = 5.0
MERGE_PATCH = "application/merge-patch+json"


class KubernetesUnavailableError(ConnectionError):
    """The Kubernetes API could not be reached (within the bounded wait)."""


class KubernetesDiscoveryError(RuntimeError):
    """The Kubernetes API refused a request (the message says what to fix)."""


@dataclass(eq=False)
class _Lease:
    lease_id: int
    ttl: float
    name: str
    keys: dict[str, bytes] = field(default_factory=dict)
    stored: dict[str, bytes] | None = None  # what the object holds; None: to be created
    labels: dict[str, str] = field(default_factory=dict)  # the object's labels
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


@dataclass(eq=False)
class _Watch:
    prefix: str
    queue: asyncio.Queue[WatchEvent]
    records: dict[str, ko.LeaseRecord]
    observed: dict[str, float]  # name -> when its renewTime was first seen (monotonic)
    version: str  # the resourceVersion to resume from
    told: dict[str, bytes] = field(default_factory=dict)  # what the watcher was told
    reaped: set[str] = field(default_factory=set)  # expired leases whose objects it deleted
    opened: asyncio.Event = field(default_factory=asyncio.Event)  # its first watch is open
    response: Any = None  # of the open watch
    connected: bool = True
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class KubernetesDiscovery(Discovery):
    def __init__(
        self,
        namespace: str | None = None,
        *,
        api: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.namespace = namespace or own_namespace() or "default"
        self.api = api
        self.connect_timeout = connect_timeout
        self.pod = os.environ.get("POD_NAME", "")
        self.pod_uid = os.environ.get("POD_UID", "")
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self._api_client: client.ApiClient | None = None
        self._where = api or "(not configured yet)"
        self._setup = asyncio.Lock()
        self._leases: dict[int, _Lease] = {}
        self._watches: weakref.WeakSet[PrefixWatch] = weakref.WeakSet()
        self._states: set[_Watch] = set()
        self._pods: dict[str, bool] | None = None  # pod -> ready, once pods are watched
        self._pods_task: asyncio.Task[None] | None = None
        self._online = True
        self._closed = False

    @classmethod
    def from_url(cls, url: str) -> KubernetesDiscovery:
        parsed = urlparse(url)
        if url != "kubernetes" and (parsed.scheme != "kubernetes" or parsed.path not in ("", "/")):
            raise ValueError(f"kubernetes discovery URL {url!r} is not kubernetes://NAMESPACE")
        query = parse_qs(parsed.query)
        unknown = set(query) - {"api"}
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)} in {url!r} (known: api)")
        return cls(parsed.netloc or None, api=query["api"][0] if "api" in query else None)

    # -- requests ----------------------------------------------------------------------------
    async def _objects(self) -> client.CustomObjectsApi:
        async with self._setup:
            if self._api_client is None:
                try:
                    configuration = await api_configuration(self.api)
                except KubeConfigError as exc:
                    raise KubernetesDiscoveryError(str(exc)) from exc
                self._where = configuration.host or "(no host)"
                self._api_client = client.ApiClient(configuration)
            return client.CustomObjectsApi(self._api_client)

    async def _call(self, what: str, request: Callable[[], Awaitable[T]]) -> T:
        """One request, bounded; failures as KubernetesUnavailableError (unreachable) or
        KubernetesDiscoveryError (refused)."""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                result = await request()
        except ApiException as exc:
            raise KubernetesDiscoveryError(self._refusal(what, exc)) from exc
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if self._online:
                log.warning("Kubernetes API at %s unreachable (%s): retrying", self._where, exc)
            self._online = False
            raise KubernetesUnavailableError(
                f"Kubernetes API at {self._where} unreachable ({what}): {exc or 'timeout'}"
            ) from exc
        if not self._online:
            log.warning("Kubernetes API at %s is reachable again", self._where)
        self._online = True
        return result

    def _refusal(self, what: str, exc: ApiException) -> str:
        where = f"{ko.PLURAL}.{ko.GROUP} in namespace {self.namespace} at {self._where}"
        if exc.status == 404 and "list" in what:
            return (
                f"cannot {what}: {where} not found; is the {ko.CRD_NAME} CRD installed? "
                "(`kvbaton deploy kubernetes` writes it)"
            )
        if exc.status == 403:
            return (
                f"cannot {what}: forbidden ({where}); the service account needs get, list, "
                f"watch, create, patch and delete on {ko.PLURAL} and get, list, watch on pods"
            )
        return f"cannot {what} ({where}): HTTP {exc.status} {exc.reason}"

    async def _bounded(self, what: str, request: Callable[[], Awaitable[T]]) -> T:
        """Retry an unreachable API for up to `connect_timeout`, then raise."""
        deadline = time.monotonic() + self.connect_timeout
        backoff = Backoff()
        while True:
            try:
                return await self._call(what, request)
            except KubernetesUnavailableError as exc:
                delay = backoff.next()
                if time.monotonic() + delay >= deadline:
                    raise KubernetesUnavailableError(
                        f"{exc} (gave up after {self.connect_timeout:g} s)"
                    ) from exc
            await asyncio.sleep(delay)

    async def _list_leases(self) -> tuple[dict[str, ko.LeaseRecord], str]:
        api = await self._objects()
        answer: Any = await self._bounded(
            "list leases",
            lambda: api.list_namespaced_custom_object(
                ko.GROUP, ko.VERSION, self.namespace, ko.PLURAL, _request_timeout=REQUEST_TIMEOUT_S
            ),
        )
        records = {}
        for item in answer.get("items") or []:
            record = ko.parse_lease(item)
            if record is not None:
                records[record.name] = record
        return records, str((answer.get("metadata") or {}).get("resourceVersion") or "")

    async def _patch(self, name: str, body: dict[str, Any]) -> None:
        api = await self._objects()
        await self._call(
            f"patch {name}",
            lambda: api.patch_namespaced_custom_object(  # type: ignore[call-arg]
                ko.GROUP,
                ko.VERSION,
                self.namespace,
                ko.PLURAL,
                name,
                body,
                _content_type=MERGE_PATCH,
                _request_timeout=REQUEST_TIMEOUT_S,
            ),
        )

    async def _delete_object(self, name: str) -> None:
        """Delete a lease's object; one that is gone already is no error."""
        api = await self._objects()
        try:
            await self._call(
                f"delete {name}",
                lambda: api.delete_namespaced_custom_object(
                    ko.GROUP,
                    ko.VERSION,
                    self.namespace,
                    ko.PLURAL,
                    name,
                    _request_timeout=REQUEST_TIMEOUT_S,
                ),
            )
        except KubernetesDiscoveryError as exc:
            if not isinstance(exc.__cause__, ApiException) or exc.__cause__.status != 404:
                raise

    async def _stream(
        self, what: str, path: Callable[..., Awaitable[Any]], version: str
    ) -> AsyncIterator[dict[str, Any]]:
        """`{"type": "OPEN", "response": ...}` once the watch is open (closing the response ends
        the stream), then its events from `version`, until the server ends it."""
        response = await self._call(
            what,
            lambda: path(
                watch="true",  # (the generated client would send "True")
                resource_version=version or None,
                allow_watch_bookmarks="true",
                timeout_seconds=WATCH_SERVER_TIMEOUT_S,
                _preload_content=False,
                _request_timeout=aiohttp.ClientTimeout(
                    sock_connect=REQUEST_TIMEOUT_S, sock_read=WATCH_SILENCE_S
                ),
            ),
        )
        try:
            yield {"type": "OPEN", "response": response}
            async for line in response.content:
                if line.strip():
                    yield json.loads(line)
        finally:
            response.release()

    # -- leases ------------------------------------------------------------------------------
    async def grant_lease(self, ttl: float) -> int:
        lease_id = secrets.randbits(62) | 1 << 62
        lease = _Lease(
            lease_id, float(ttl), ko.object_name(self.pod or socket.gethostname(), lease_id)
        )
        await self._bounded(f"create lease {lease.name}", lambda: self._sync(lease))
        self._leases[lease_id] = lease
        lease.task = asyncio.create_task(self._keepalive(lease), name=f"kube-lease-{lease.name}")
        return lease_id

    async def _sync(self, lease: _Lease, renew: bool = False) -> None:
        """Bring the lease's object in line with its keys (creating it when needed)."""
        keys = dict(lease.keys)
        labels = ko.labels_for(keys)
        now = ko.rfc3339(time.time())
        if lease.stored is None:
            body = ko.lease_object(
                name=lease.name,
                namespace=self.namespace,
                keys=keys,
                pod=self.pod,
                pod_uid=self.pod_uid,
                holder=self.holder,
                ttl=lease.ttl,
                renew=now,
            )
            api = await self._objects()
            try:
                await self._call(
                    f"create {lease.name}",
                    lambda: api.create_namespaced_custom_object(
                        ko.GROUP,
                        ko.VERSION,
                        self.namespace,
                        ko.PLURAL,
                        body,
                        _request_timeout=REQUEST_TIMEOUT_S,
                    ),
                )
            except KubernetesDiscoveryError as exc:
                if not isinstance(exc.__cause__, ApiException) or exc.__cause__.status != 409:
                    raise
                lease.stored, lease.labels = {}, {}  # it exists (an earlier try got through)
                return await self._sync(lease, renew=True)
            lease.stored, lease.labels = keys, labels
            return
        changes: dict[str, bytes | None] = {
            k: v for k, v in keys.items() if lease.stored.get(k) != v
        }
        changes.update({k: None for k in lease.stored.keys() - keys.keys()})
        label_changes: dict[str, str | None] = {
            k: v for k, v in labels.items() if lease.labels.get(k) != v
        }
        label_changes.update({k: None for k in lease.labels.keys() - labels.keys()})
        if not (changes or label_changes or renew):
            return
        patch: dict[str, Any] = {"spec": {"renewTime": now}}
        if changes:
            patch["spec"]["keys"] = ko.encode_keys(changes)
        if label_changes:
            patch["metadata"] = {"labels": label_changes}
        try:
            await self._patch(lease.name, patch)
        except KubernetesDiscoveryError as exc:
            if not isinstance(exc.__cause__, ApiException) or exc.__cause__.status != 404:
                raise
            log.warning("lease %s was deleted; creating it again with its keys", lease.name)
            lease.stored = None
            return await self._sync(lease)
        lease.stored, lease.labels = keys, labels

    async def _keepalive(self, lease: _Lease) -> None:
        backoff = Backoff()
        due = time.monotonic() + lease.ttl / 3
        while True:
            renew = time.monotonic() >= due
            try:
                async with lease.lock:
                    await self._sync(lease, renew=renew)
                if renew:
                    due = time.monotonic() + lease.ttl / 3
                backoff.reset()
                wait = max(0.0, due - time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # unreachable or refused: retry, never give up
                if not isinstance(exc, KubernetesUnavailableError):
                    log.warning("keep-alive of lease %s failed: %s", lease.name, exc)
                wait = backoff.next()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await lease.wake.wait()
            lease.wake.clear()

    async def _write(self, lease: _Lease) -> None:
        """Apply the lease's keys now if the API is there; else leave it to the keep-alive."""
        if self._online:
            try:
                async with lease.lock:
                    await self._sync(lease)
                return
            except KubernetesUnavailableError:
                pass
        lease.wake.set()

    async def revoke_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        if lease.task is not None:
            lease.task.cancel()
            await asyncio.gather(lease.task, return_exceptions=True)
        try:
            await self._delete_object(lease.name)
        except (KubernetesUnavailableError, KubernetesDiscoveryError) as exc:
            log.warning("could not delete lease %s (it expires): %s", lease.name, exc)

    async def put(self, key: str, value: bytes, lease_id: int) -> None:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise KeyError(f"lease {lease_id:x} is not held by this process")
        for other in self._leases.values():
            if other is not lease and key in other.keys:
                del other.keys[key]
                await self._write(other)
        lease.keys[key] = value
        await self._write(lease)

    async def delete(self, key: str) -> None:
        owner = next((lease for lease in self._leases.values() if key in lease.keys), None)
        if owner is not None:
            del owner.keys[key]
            await self._write(owner)
            return
        records, _ = await self._list_leases()
        for record in records.values():
            if key in record.keys:
                await self._patch(record.name, {"spec": {"keys": {key: None}}})

    # -- reading -----------------------------------------------------------------------------
    def _visible(
        self, records: dict[str, ko.LeaseRecord], observed: dict[str, float] | None
    ) -> dict[str, bytes]:
        """The keys of live leases whose pods are ready (the newest lease wins a key)."""
        now, wall = time.monotonic(), time.time()
        keys: dict[str, tuple[float, bytes]] = {}
        for record in records.values():
            if self._expired(record, observed, now, wall):
                continue
            if record.pod and not (self._pods or {}).get(record.pod, False):
                continue
            for key, value in record.keys.items():
                if key not in keys or keys[key][0] < record.renew_wall:
                    keys[key] = (record.renew_wall, value)
        return {k: v for k, (_, v) in keys.items()}

    @staticmethod
    def _expired(
        record: ko.LeaseRecord, observed: dict[str, float] | None, now: float, wall: float
    ) -> bool:
        if observed is not None and observed.get(record.name, now) + record.ttl < now:
            return True
        return record.renew_wall + 2 * record.ttl + SKEW_S < wall

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        records, _ = await self._list_leases()
        await self._ensure_pods(records)
        return {k: v for k, v in self._visible(records, None).items() if k.startswith(prefix)}

    async def watch_prefix(self, prefix: str) -> PrefixWatch:
        records, version = await self._list_leases()
        await self._ensure_pods(records)
        now = time.monotonic()
        state = _Watch(prefix, asyncio.Queue(), records, dict.fromkeys(records, now), version)
        follow = asyncio.create_task(self._follow(state), name=f"kube-watch {prefix}")
        state.tasks = [follow, asyncio.create_task(self._tick(state), name=f"kube-expiry {prefix}")]
        opened = asyncio.create_task(state.opened.wait())
        await asyncio.wait(
            {opened, follow}, timeout=self.connect_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if not state.opened.is_set():
            opened.cancel()
            self._unwatch(state)
            await asyncio.gather(*state.tasks, return_exceptions=True)
            raise KubernetesUnavailableError(
                f"could not open a watch of {ko.PLURAL} at {self._where} within "
                f"{self.connect_timeout:g} s"
            )
        self._states.add(state)
        watch = PrefixWatch(dict(state.told), state.queue, lambda: self._unwatch(state))
        self._watches.add(watch)
        return watch

    def _told(self, state: _Watch) -> dict[str, bytes]:
        visible = self._visible(state.records, state.observed)
        return {k: v for k, v in visible.items() if k.startswith(state.prefix)}

    def _publish(self, state: _Watch) -> None:
        """Tell the watcher what changed since it was last told."""
        current = self._told(state)
        for key in state.told.keys() - current.keys():
            state.queue.put_nowait(WatchEvent("delete", key, None))
        for key, value in current.items():
            if state.told.get(key) != value:
                state.queue.put_nowait(WatchEvent("put", key, value))
        state.told = current

    def _unwatch(self, state: _Watch) -> None:
        self._states.discard(state)
        for task in state.tasks:
            task.cancel()

    def _apply(self, state: _Watch, record: ko.LeaseRecord | None, name: str) -> None:
        old = state.records.get(name)
        if record is None:
            state.records.pop(name, None)
            state.observed.pop(name, None)
            state.reaped.discard(name)
        else:
            state.records[name] = record
            if old is None or old.renew != record.renew:
                state.observed[name] = time.monotonic()

    async def _follow(self, state: _Watch) -> None:
        api = await self._objects()
        lister = _lease_lister(api, self.namespace)
        backoff = Backoff()
        while True:
            try:
                await self._ensure_pods(state.records)
                async for event in self._stream(f"watch {ko.PLURAL}", lister, state.version):
                    if event["type"] == "OPEN":
                        state.response = event["response"]
                        if not state.opened.is_set():  # see the module's docstring
                            await self._relist(state, publish=False)
                            state.told = self._told(state)
                            state.opened.set()
                        continue
                    if self._gone(event):
                        raise _Gone
                    state.version = _version(event) or state.version
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        record = ko.parse_lease(event.get("object"))
                        name = (event.get("object") or {}).get("metadata", {}).get("name", "")
                        deleted = event["type"] == "DELETED"
                        self._apply(state, None if deleted or record is None else record, name)
                        self._publish(state)
                    state.connected = True
                    backoff.reset()
                continue  # the server ended the watch: resume from the last version
            except asyncio.CancelledError:
                raise
            except _Gone:
                log.info("watch of %s: resourceVersion too old; listing again", state.prefix)
            except KubernetesDiscoveryError as exc:
                if not isinstance(exc.__cause__, ApiException) or exc.__cause__.status != 410:
                    log.warning("watch of %s failed: %s", state.prefix, exc)
                    state.connected = False
            except Exception as exc:  # broken stream, unreachable API
                log.debug("watch of %s broke: %r", state.prefix, exc)
                state.connected = False
            await asyncio.sleep(backoff.next())
            await self._relist(state)

    async def _relist(self, state: _Watch, publish: bool = True) -> None:
        with contextlib.suppress(KubernetesUnavailableError, KubernetesDiscoveryError):
            records, version = await self._list_leases()
            fresh = not state.connected  # after an outage every lease gets a fresh TTL
            for name in state.records.keys() - records.keys():
                self._apply(state, None, name)
            for name, record in records.items():
                self._apply(state, record, name)
                if fresh:
                    state.observed[name] = time.monotonic()
            state.version, state.connected = version, True
            if publish:
                self._publish(state)

    @staticmethod
    def _gone(event: dict[str, Any]) -> bool:
        obj = event.get("object") or {}
        return event.get("type") == "ERROR" and obj.get("code") == 410

    async def _tick(self, state: _Watch) -> None:
        """Expire leases whose renewals stopped, once a read confirms it, and reap them."""
        while True:
            ttl = min((r.ttl for r in state.records.values()), default=1.0)
            await asyncio.sleep(max(0.05, min(0.5, ttl / 8)))
            now, wall = time.monotonic(), time.time()
            due = [
                r
                for r in state.records.values()
                if r.name not in state.reaped and self._expired(r, state.observed, now, wall)
            ]
            if due and state.connected:
                await self._confirm(state, due)
            if state.connected:
                self._publish(state)

    async def _confirm(self, state: _Watch, due: list[ko.LeaseRecord]) -> None:
        """Read the leases that look expired: a renewal the watch did not bring means the
        watch is stuck (a half-open connection): it starts again. The rest are reaped."""
        api = await self._objects()
        try:
            answer: Any = await self._call(
                "list leases",
                lambda: api.list_namespaced_custom_object(
                    ko.GROUP,
                    ko.VERSION,
                    self.namespace,
                    ko.PLURAL,
                    _request_timeout=REQUEST_TIMEOUT_S,
                ),
            )
        except (KubernetesUnavailableError, KubernetesDiscoveryError):
            state.connected = False  # an outage: keep what is known
            return
        listed = {r.name: r for r in map(ko.parse_lease, answer.get("items") or []) if r}
        if any(r.name in listed and listed[r.name].renew != r.renew for r in due):
            log.warning("the watch of %s missed renewals; watching again", state.prefix)
            if state.response is not None:
                state.response.close()
        for record in due:
            self._apply(state, listed.get(record.name), record.name)
            if record.name in listed and listed[record.name].renew == record.renew:
                log.info("lease %s expired (no renewal for %g s)", record.name, record.ttl)
                state.reaped.add(record.name)
                with contextlib.suppress(Exception):
                    await self._delete_object(record.name)

    # -- pods --------------------------------------------------------------------------------
    async def _ensure_pods(self, records: dict[str, ko.LeaseRecord]) -> None:
        """From the first lease that names a pod on: know which pods are ready."""
        if self._pods is not None or not any(r.pod for r in records.values()):
            return
        async with self._setup:
            if self._pods_task is None:
                self._pods_task = asyncio.create_task(self._follow_pods(), name="kube-pods")
        while self._pods is None:
            await asyncio.sleep(0.02)
            if self._pods_task.done():
                self._pods_task.result()  # raise what stopped it

    async def _pod_list(self) -> tuple[dict[str, bool], str]:
        await self._objects()
        core = client.CoreV1Api(self._api_client)
        response: Any = await self._bounded(
            "list pods",
            lambda: core.list_namespaced_pod(
                self.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
            ),
        )
        answer = json.loads(await response.read())
        pods = {p["metadata"]["name"]: ko.pod_ready(p) for p in answer.get("items") or []}
        return pods, str((answer.get("metadata") or {}).get("resourceVersion") or "")

    async def _follow_pods(self) -> None:
        self._pods, version = await self._pod_list()
        self._publish_all()
        core = client.CoreV1Api(self._api_client)
        backoff = Backoff()
        while True:
            try:
                lister = _pod_lister(core, self.namespace)
                async for event in self._stream("watch pods", lister, version):
                    if self._gone(event):
                        raise _Gone
                    version = _version(event) or version
                    obj = event.get("object") or {}
                    name = (obj.get("metadata") or {}).get("name")
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED") and name:
                        ready = event["type"] != "DELETED" and ko.pod_ready(obj)
                        if self._pods.get(name) != ready:
                            self._pods[name] = ready
                            self._publish_all()
                    backoff.reset()
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("watch of pods broke: %r", exc)
            await asyncio.sleep(backoff.next())
            with contextlib.suppress(KubernetesUnavailableError, KubernetesDiscoveryError):
                self._pods, version = await self._pod_list()
                self._publish_all()

    def _publish_all(self) -> None:
        for state in list(self._states):
            self._publish(state)

    # -- closing -----------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop watches and keep-alives, delete our leases' objects (bounded), close."""
        if self._closed:
            return
        self._closed = True
        tasks = [t for s in self._states for t in s.tasks]
        for watch in list(self._watches):
            watch.close()
        self._states.clear()
        if self._pods_task is not None:
            tasks.append(self._pods_task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await asyncio.gather(
                    *(self.revoke_lease(lid) for lid in list(self._leases)),
                    return_exceptions=True,
                )
        for lease in self._leases.values():  # the deletes ran out of time: they expire
            if lease.task is not None:
                lease.task.cancel()
        self._leases.clear()
        if self._api_client is not None:
            with contextlib.suppress(Exception):
                await self._api_client.close()


class _Gone(Exception):
    """The watch cannot resume from its resourceVersion."""


def _version(event: dict[str, Any]) -> str:
    obj = event.get("object") or {}
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def _lease_lister(api: client.CustomObjectsApi, namespace: str) -> Callable[..., Awaitable[Any]]:
    def lister(**kwargs: Any) -> Awaitable[Any]:
        return api.list_namespaced_custom_object(
            ko.GROUP, ko.VERSION, namespace, ko.PLURAL, **kwargs
        )

    return lister


def _pod_lister(core: client.CoreV1Api, namespace: str) -> Callable[..., Awaitable[Any]]:
    def lister(**kwargs: Any) -> Awaitable[Any]:
        return core.list_namespaced_pod(namespace, **kwargs)

    return lister
