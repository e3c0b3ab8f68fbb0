"""A Kubernetes lease watch after an API outage longer than a lease's TTL, whichever of its
calls gets through first: no lease is taken for dead before its owner had a TTL to renew it
(kube_watch.py). Driven by a scripted API whose lists fail while its watch stays open (an
overloaded API server), so that the watch is the first to bring the API's return."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvbaton.runtime.discovery import WatchEvent
from kvbaton.runtime.discovery import kube_objects as ko
from kvbaton.runtime.discovery.kube_requests import KubernetesUnavailableError
from kvbaton.runtime.discovery.kube_watch import LeaseWatch, PodReadiness
from tests.helpers import wait_until

pytestmark = pytest.mark.unit

TTL = 0.5
KEY_1, KEY_2 = "/services/ns/backend/generate-1", "/services/ns/backend/generate-2"


def lease(name: str, key: str, renewed: float) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "resourceVersion": str(int(renewed * 1e6))},
        "spec": {
            "keys": {key: base64.b64encode(key.encode()).decode()},
            "ttlSeconds": TTL,
            "renewTime": ko.rfc3339(renewed),
        },
    }


class _Response:
    def close(self) -> None:
        pass


class ScriptedApi:
    """Leases by name; lists get through only while `lists_up`; one watch stays open."""

    connect_timeout = 5.0
    where = "scripted"

    def __init__(self, *objects: dict[str, Any]) -> None:
        self.objects = {o["metadata"]["name"]: o for o in objects}
        self.lists_up = True
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.deleted: list[str] = []

    async def list_leases(self, *, retry: bool = True) -> tuple[dict[str, ko.LeaseRecord], str]:
        if not self.lists_up:
            raise KubernetesUnavailableError("scripted outage")
        records = {name: ko.parse_lease(o) for name, o in self.objects.items()}
        return {n: r for n, r in records.items() if r is not None}, "1"

    async def watch_leases(self, version: str) -> AsyncIterator[dict[str, Any]]:
        yield {"type": "OPEN", "response": _Response()}
        while True:
            yield await self.events.get()

    async def delete(self, name: str, version: str = "") -> None:
        self.deleted.append(name)
        self.objects.pop(name, None)

    def change(self, kind: str, obj: dict[str, Any]) -> None:
        self.objects[obj["metadata"]["name"]] = obj
        self.events.put_nowait({"type": kind, "object": obj})


async def test_a_watch_that_brings_the_apis_return_gives_every_lease_a_fresh_ttl() -> None:
    api = ScriptedApi(lease("generate-1", KEY_1, time.time()))
    records, version = await api.list_leases()
    pods = PodReadiness(api, lambda: None)  # type: ignore[arg-type]
    watch = LeaseWatch(api, pods, "/services/", records, version)  # type: ignore[arg-type]
    prefix_watch = await watch.start(lambda: None)
    try:
        assert prefix_watch.snapshot == {KEY_1: KEY_1.encode()}
        api.lists_up = False  # for 3 TTLs: nobody renews; the reaper's confirmation fails
        await wait_until(lambda: not watch.connected, timeout=5.0)
        await asyncio.sleep(3 * TTL)
        api.lists_up = True  # back, told first by the watch: a lease put meanwhile
        api.change("ADDED", lease("generate-2", KEY_2, time.time()))
        event = await asyncio.wait_for(prefix_watch.__anext__(), 5.0)
        assert event == WatchEvent("put", KEY_2, KEY_2.encode())
        await asyncio.sleep(TTL / 2)  # within a fresh TTL, the owner renews its lease
        api.change("MODIFIED", lease("generate-1", KEY_1, time.time()))
        await wait_until(
            lambda: (
                watch.records["generate-1"].renew == api.objects["generate-1"]["spec"]["renewTime"]
            )
        )
        assert api.deleted == [] and watch.reaped == set() and prefix_watch._queue.empty()
    finally:
        await prefix_watch.aclose()
        await watch.stop()
