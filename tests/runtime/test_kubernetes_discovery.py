"""What only kubernetes discovery does (the shared contract runs in test_discovery.py): leases
that stop renewing, pod readiness, objects deleted under their owner, watches that cannot resume
(410 Gone), API outages, and clear errors. Against kmock's emulator, in this process, so that a
test can change pods, inject answers and stop the API."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvbaton.runtime.discovery import PrefixWatch, WatchEvent, open_discovery
from kvbaton.runtime.discovery import kube_objects as ko
from kvbaton.runtime.discovery.kubernetes import (
    KubernetesDiscovery,
    KubernetesDiscoveryError,
    KubernetesUnavailableError,
)
from tests.helpers import wait_until
from tests.kube_standin import declare

pytestmark = pytest.mark.unit

kmock = pytest.importorskip("kmock", reason="kmock is in the test extra")

NS = "kv-test"
LEASES = f"{ko.API_VERSION}/{ko.PLURAL}"
KEY = "/services/ns/backend/generate-1"


class Api:
    """An emulated API server behind a TCP relay that can be cut (an outage: connections reset,
    the port refused) and restored on the same port."""

    def __init__(self) -> None:
        self.emulator: Any = None
        self.server: Any = None
        self.port = 0
        self._relay: asyncio.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def restore(self) -> None:
        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.server.port)
            self._pipes |= {writer, up_writer}
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        self._relay = await asyncio.start_server(relay, "127.0.0.1", self.port)
        self.port = self._relay.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._relay is not None
        self._relay.close()
        for writer in self._pipes:
            writer.transport.abort()
        self._pipes.clear()
        await self._relay.wait_closed()

    def objects(self) -> dict[str, dict[str, Any]]:
        return {
            name: obj.raw
            for (resource, ns, name), obj in self.emulator.objects.items()
            if str(resource) == str(kmock.resource(LEASES)) and ns == NS and not obj.deleted
        }


@pytest.fixture
async def api() -> AsyncIterator[Api]:
    api = Api()
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        declare(emulator)
        api.emulator, api.server = emulator, server
        await api.restore()
        try:
            yield api
        finally:
            await api.cut()


def disc(api: Api) -> KubernetesDiscovery:
    return KubernetesDiscovery(NS, api=api.url, connect_timeout=2.0)


def disc_in_pod(api: Api, monkeypatch: pytest.MonkeyPatch) -> KubernetesDiscovery:
    """A handle of a process in the pod `worker-0` (as the downward API tells it)."""
    with monkeypatch.context() as env:
        env.setenv("POD_NAME", "worker-0")
        env.setenv("POD_UID", "uid-worker-0")
        return disc(api)


async def next_event(watch: PrefixWatch, timeout: float = 5.0) -> WatchEvent:
    return await asyncio.wait_for(watch.__anext__(), timeout)


async def watching(api: Api, resource: str = LEASES, count: int = 1) -> None:
    """Until `count` watches of `resource` are open. (kmock does not replay what changed between
    a list and the watch after it, as a real API server does from the list's resourceVersion.)"""
    watches = api.emulator["watch", kmock.resource(resource)]
    await wait_until(lambda: len(list(watches)) >= count, 5.0, f"{count} watches of {resource}")
    await asyncio.sleep(0.2)


def pod(name: str, ready: bool, terminating: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": NS, "uid": f"uid-{name}"}
    if terminating:
        metadata["deletionTimestamp"] = "2026-11-30T00:00:00Z"
    status = "True" if ready else "False"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "status": {"conditions": [{"type": "Ready", "status": status}]},
    }


async def set_pod(api: Api, body: dict[str, Any]) -> None:
    """Through the API, so that watchers hear of it."""
    client = api.server.client
    url = f"/api/v1/namespaces/{NS}/pods"
    response = await client.patch(
        f"{url}/{body['metadata']['name']}",
        json=body,
        headers={"Content-Type": "application/merge-patch+json"},
    )
    if response.status == 404:
        response = await client.post(url, json=body)
    assert response.status < 300, await response.text()


def test_urls() -> None:
    assert isinstance(open_discovery("kubernetes"), KubernetesDiscovery)
    named = open_discovery("kubernetes://team-a?api=http://127.0.0.1:8001")
    assert isinstance(named, KubernetesDiscovery)
    assert (named.namespace, named.api) == ("team-a", "http://127.0.0.1:8001")
    for bad in ("kubernetes://team-a/extra", "kubernetes://ns?apii=x"):
        with pytest.raises(ValueError, match="kubernetes"):
            open_discovery(bad)


async def test_keys_of_a_lease_no_longer_renewed_vanish_within_its_ttl(api: Api) -> None:
    writer, reader = disc(api), disc(api)
    ttl = 1.0
    try:
        lease = await writer.grant_lease(ttl)
        await writer.put(KEY, b"one", lease)
        watch = await reader.watch_prefix("/services/")
        assert watch.snapshot == {KEY: b"one"}
        # The writer "dies": no more renewals.
        task = writer._leases[lease].task
        assert task is not None
        task.cancel()
        t0 = time.monotonic()
        assert await next_event(watch) == WatchEvent("delete", KEY, None)
        waited = time.monotonic() - t0
        assert waited <= ttl + 0.6, f"dropped after {waited:.2f}s, TTL {ttl}s"
        await wait_until(lambda: not api.objects(), 3.0, "the reader reaped the object")
    finally:
        writer._leases.clear()
        await writer.close()
        await reader.close()


async def test_a_lease_in_a_pod_is_owned_by_it_and_hidden_while_it_is_not_ready(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = disc_in_pod(api, monkeypatch), disc(api)
    await set_pod(api, pod("worker-0", ready=False))
    try:
        lease = await writer.grant_lease(10)
        await writer.put(KEY, b"one", lease)
        (obj,) = api.objects().values()
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Pod", "name": "worker-0", "uid": "uid-worker-0"}
        ]
        assert obj["metadata"]["labels"][ko.LABEL_ENDPOINT_PREFIX + "generate"] == "true"
        assert obj["metadata"]["labels"][ko.LABEL_COMPONENT] == "backend"
        assert obj["spec"]["pod"] == "worker-0"
        assert await reader.get_prefix("/services/") == {}
        watch = await reader.watch_prefix("/services/")
        assert watch.snapshot == {}
        await watching(api, "v1/pods")
        await set_pod(api, pod("worker-0", ready=True))
        assert await next_event(watch) == WatchEvent("put", KEY, b"one")
        assert await reader.get_prefix("/services/") == {KEY: b"one"}
        await set_pod(api, pod("worker-0", ready=True, terminating=True))
        assert await next_event(watch) == WatchEvent("delete", KEY, None)
        await set_pod(api, pod("worker-0", ready=True))
        assert await next_event(watch) == WatchEvent("put", KEY, b"one")
        response = await api.server.client.delete(f"/api/v1/namespaces/{NS}/pods/worker-0")
        assert response.status == 200
        assert await next_event(watch) == WatchEvent("delete", KEY, None)
    finally:
        await writer.close()
        await reader.close()


async def test_a_deleted_lease_object_is_created_again_with_every_key(api: Api) -> None:
    writer, reader = disc(api), disc(api)
    try:
        lease = await writer.grant_lease(1.0)
        await writer.put(KEY, b"one", lease)
        await writer.put("/models/ns/m/1", b"card", lease)
        watch = await reader.watch_prefix("/")
        await watching(api)
        (name,) = api.objects()
        response = await api.server.client.delete(
            f"/apis/{ko.API_VERSION}/namespaces/{NS}/{ko.PLURAL}/{name}"
        )
        assert response.status == 200
        seen = {await next_event(watch), await next_event(watch)}
        assert seen == {
            WatchEvent("delete", KEY, None),
            WatchEvent("delete", "/models/ns/m/1", None),
        }
        # The next renewal (within TTL/3) finds it gone and creates it again, same lease.
        seen = {await next_event(watch), await next_event(watch)}
        assert seen == {
            WatchEvent("put", KEY, b"one"),
            WatchEvent("put", "/models/ns/m/1", b"card"),
        }
        assert list(api.objects()) == [name]
    finally:
        await writer.close()
        await reader.close()


async def test_a_watch_that_cannot_resume_lists_again(api: Api) -> None:
    writer, reader = disc(api), disc(api)
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}
    try:
        lease = await writer.grant_lease(10)
        await writer.put(KEY, b"one", lease)
        # The first watch request is answered 410 Gone, the second with a 410 ERROR event.
        watches = api.emulator["watch", kmock.resource(LEASES)]
        watches[:1] << 410
        watches[1:2] << (gone,)
        watch = await reader.watch_prefix("/services/")
        assert watch.snapshot == {KEY: b"one"}
        await writer.put(KEY, b"two", lease)
        assert await next_event(watch) == WatchEvent("put", KEY, b"two")
        await wait_until(lambda: len(list(watches)) >= 3, 5.0, "the third watch")
    finally:
        await writer.close()
        await reader.close()


async def test_an_outage_keeps_what_is_known_and_writes_land_when_the_api_returns(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = disc_in_pod(api, monkeypatch), disc(api)
    await set_pod(api, pod("worker-0", ready=True))
    ttl = 1.0
    try:
        lease = await writer.grant_lease(ttl)
        await writer.put(KEY, b"one", lease)
        watch = await reader.watch_prefix("/services/")
        assert watch.snapshot == {KEY: b"one"}
        await api.cut()
        await writer.put("/services/ns/backend/generate-2", b"two", lease)  # remembered
        # Longer than the TTL, and than what a wall clock allows (2 TTL + 5 s): nobody could
        # renew, and no reader may take that for the owner's death.
        await asyncio.sleep(8 * ttl)
        with pytest.raises(KubernetesUnavailableError, match="unreachable"):
            await reader.get_prefix("/services/")
        await api.restore()
        event = await next_event(watch, timeout=10.0)
        assert event == WatchEvent("put", "/services/ns/backend/generate-2", b"two")
        await asyncio.sleep(2 * ttl)  # the lease outlives the outage: renewed again
        assert await reader.get_prefix("/services/") == {
            KEY: b"one",
            "/services/ns/backend/generate-2": b"two",
        }
        assert watch._queue.empty(), "a key went and came back during the outage"
    finally:
        await writer.close()
        await reader.close()


async def test_a_watch_that_began_before_any_pod_sees_a_ready_pod_s_keys(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a frontend does, started before the workers: no lease names a pod yet."""
    reader = KubernetesDiscovery(NS, api=api.url, connect_timeout=60.0)
    writer = disc_in_pod(api, monkeypatch)
    try:
        # It returns once its watch is open, not when its connect timeout runs out.
        watch = await asyncio.wait_for(reader.watch_prefix("/services/"), 30.0)
        assert watch.snapshot == {}
        await set_pod(api, pod("worker-0", ready=True))
        lease = await writer.grant_lease(10)
        await writer.put(KEY, b"one", lease)
        assert await next_event(watch) == WatchEvent("put", KEY, b"one")
    finally:
        await writer.close()
        await reader.close()


async def test_without_an_api_the_first_contact_fails_in_bounded_time() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    discovery = KubernetesDiscovery(NS, api=f"http://127.0.0.1:{port}", connect_timeout=1.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(KubernetesUnavailableError, match="gave up after 1 s"):
            await discovery.grant_lease(10)
        with pytest.raises(KubernetesUnavailableError):
            await discovery.watch_prefix("/")
    finally:
        await discovery.close()
    assert time.monotonic() - t0 < 4.0


async def test_a_missing_crd_and_a_forbidden_list_are_clear_errors() -> None:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        discovery = KubernetesDiscovery(NS, api=f"http://127.0.0.1:{server.port}")
        try:
            with pytest.raises(
                KubernetesDiscoveryError, match=r"is the kvbatonleases\.kvbaton\.dev CRD installed"
            ):
                await discovery.get_prefix("/")
            declare(emulator)
            watches = emulator["watch", kmock.resource(LEASES)]
            watches[:1] << 403
            with pytest.raises(KubernetesDiscoveryError, match=r"forbidden.*service account"):
                await discovery.watch_prefix("/")
            emulator["list", kmock.resource(LEASES)] << 403
            with pytest.raises(KubernetesDiscoveryError, match=r"forbidden.*service account"):
                await discovery.watch_prefix("/")
        finally:
            await discovery.close()


async def test_a_forbidden_pod_list_is_a_clear_error(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = disc_in_pod(api, monkeypatch), disc(api)
    api.emulator["list", kmock.resource("v1/pods")] << 403
    try:
        await writer.put(KEY, b"one", await writer.grant_lease(10))
        with pytest.raises(KubernetesDiscoveryError, match=r"cannot list pods: forbidden"):
            await reader.get_prefix("/services/")
    finally:
        await writer.close()
        await reader.close()


@pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="no KUBECONFIG set: no real cluster")
async def test_a_real_cluster() -> None:
    """Against the cluster of KUBECONFIG, in $KVBATON_TEST_K8S_NAMESPACE (default: default);
    installs the CRD if it is missing."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    from kvbaton.runtime.kube_api import api_configuration

    namespace = os.environ.get("KVBATON_TEST_K8S_NAMESPACE", "default")
    async with client.ApiClient(await api_configuration()) as api:
        try:
            await client.ApiextensionsV1Api(api).create_custom_resource_definition(
                ko.crd_manifest()
            )
        except ApiException as exc:
            if exc.status != 409:
                raise
    writer, reader = KubernetesDiscovery(namespace), KubernetesDiscovery(namespace)
    key = f"/services/t-{uuid.uuid4().hex[:8]}/backend/generate-1"
    try:
        deadline = time.monotonic() + 30
        while True:  # a new CRD takes a moment to be served
            try:
                lease = await writer.grant_lease(10)
                break
            except KubernetesDiscoveryError:
                assert time.monotonic() < deadline, "the CRD is not served"
                await asyncio.sleep(1)
        await writer.put(key, b"one", lease)
        watch = await reader.watch_prefix(key)
        assert watch.snapshot == {key: b"one"}
        await writer.put(key, b"two", lease)
        assert await next_event(watch) == WatchEvent("put", key, b"two")
        await writer.revoke_lease(lease)
        assert await next_event(watch) == WatchEvent("delete", key, None)
    finally:
        await writer.close()
        await reader.close()
