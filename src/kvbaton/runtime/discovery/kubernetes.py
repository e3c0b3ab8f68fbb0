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

Readers see the keys of live leases whose pods are Ready (kube_watch.py says when a lease is
live, and how watches list, resume and recover).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlparse

from kvbaton.runtime.discovery import kube_objects as ko
from kvbaton.runtime.discovery.base import Backoff, Discovery, PrefixWatch
from kvbaton.runtime.discovery.kube_requests import (
    CONNECT_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    KubernetesDiscoveryError,
    KubernetesUnavailableError,
    LeaseApi,
    log,
    refused_with,
)
from kvbaton.runtime.discovery.kube_watch import (
    LeaseWatch,
    PodReadiness,
    renewed_lately,
    visible,
)
from kvbaton.runtime.kube_api import own_namespace

__all__ = ["KubernetesDiscovery", "KubernetesDiscoveryError", "KubernetesUnavailableError"]

CLOSE_TIMEOUT_S = 2.0


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
    revoked: bool = False  # its object is deleted: never created again


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
        self.pod = os.environ.get("POD_NAME", "")
        self.pod_uid = os.environ.get("POD_UID", "")
        pod_namespace = own_namespace()
        if self.pod and pod_namespace and pod_namespace != self.namespace:
            log.warning(
                "pod %s is in namespace %s, discovery in %s: its leases are not owned by the "
                "pod, nor gated by its readiness",
                self.pod,
                pod_namespace,
                self.namespace,
            )
            self.pod = self.pod_uid = ""
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self._api = LeaseApi(self.namespace, api, connect_timeout)
        self._pods = PodReadiness(self._api, self._publish_all)
        self._leases: dict[int, _Lease] = {}
        self._watches: dict[PrefixWatch, LeaseWatch] = {}
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

    # -- leases ------------------------------------------------------------------------------
    async def grant_lease(self, ttl: float) -> int:
        lease_id = secrets.randbits(62) | 1 << 62
        lease = _Lease(
            lease_id, float(ttl), ko.object_name(self.pod or socket.gethostname(), lease_id)
        )
        await self._api.bounded(f"create lease {lease.name}", lambda: self._sync(lease))
        self._leases[lease_id] = lease
        lease.task = asyncio.create_task(self._keepalive(lease), name=f"kube-lease-{lease.name}")
        return lease_id

    async def _sync(self, lease: _Lease, renew: bool = False) -> None:
        """Bring the lease's object in line with its keys (creating it when needed); the
        caller holds `lease.lock`."""
        if lease.revoked:
            return
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
            try:
                await self._api.create(body)
            except KubernetesDiscoveryError as exc:
                if not refused_with(exc, 409):
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
            # A renewal is bounded by a third of the TTL (a late one is as good as none).
            await self._api.patch(lease.name, patch, min(REQUEST_TIMEOUT_S, lease.ttl / 3))
        except KubernetesDiscoveryError as exc:
            if not refused_with(exc, 404):
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
                # No longer apart than a renewal: after an outage readers give every lease a
                # fresh TTL (kube_watch.py), which the first renewal must beat.
                wait = min(backoff.next(), lease.ttl / 3)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await lease.wake.wait()
            lease.wake.clear()

    async def _write(self, lease: _Lease) -> None:
        """Apply the lease's keys now if the API is there; else leave it to the keep-alive."""
        if self._api.online:
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
        async with lease.lock:  # after any write in flight; none after it
            lease.revoked = True
            try:
                await self._api.delete(lease.name)
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
        records, _ = await self._api.list_leases()
        for record in records.values():
            if key in record.keys:
                await self._api.patch(record.name, {"spec": {"keys": {key: None}}})

    # -- reading -----------------------------------------------------------------------------
    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        records, _ = await self._api.list_leases()
        await self._pods.ensure(records)
        keys = visible(records, self._pods, renewed_lately)
        return {k: v for k, v in keys.items() if k.startswith(prefix)}

    async def watch_prefix(self, prefix: str) -> PrefixWatch:
        records, version = await self._api.list_leases()
        await self._pods.ensure(records)
        state = LeaseWatch(self._api, self._pods, prefix, records, version)
        watch = await state.start(lambda: self._unwatch(watch))
        self._watches[watch] = state
        return watch

    def _unwatch(self, watch: PrefixWatch) -> None:
        state = self._watches.pop(watch, None)
        if state is not None:
            for task in state.tasks:
                task.cancel()

    def _publish_all(self) -> None:
        for state in list(self._watches.values()):
            state.publish()

    # -- closing -----------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop watches and keep-alives, delete our leases' objects (bounded), close."""
        if self._closed:
            return
        self._closed = True
        states = list(self._watches.values())
        for watch in list(self._watches):
            watch.close()
        await asyncio.gather(*(state.stop() for state in states))
        await self._pods.close()
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
        with contextlib.suppress(Exception):
            await self._api.close()
