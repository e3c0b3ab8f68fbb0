"""The requests of `--discovery kubernetes` to the API server: KvbatonLease objects (list,
create, merge-patch, delete, watch) and pods (list, watch), each bounded, their failures as two
errors: `KubernetesUnavailableError` (the API cannot be reached) and `KubernetesDiscoveryError`
(it refused; the message says what to fix). Watches are read as raw JSON lines."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from kvbaton.runtime.discovery import kube_objects as ko
from kvbaton.runtime.discovery.base import Backoff
from kvbaton.runtime.kube_api import KubeConfigError, api_configuration

log = logging.getLogger("kvbaton.runtime.discovery.kubernetes")

T = TypeVar("T")

CONNECT_TIMEOUT_S = 5.0  # first contact and reads: then a clear error
REQUEST_TIMEOUT_S = 5.0  # any single request
WATCH_SERVER_TIMEOUT_S = 240  # the API server ends a watch after this; it is resumed
WATCH_SILENCE_S = 300.0  # a watch silent for longer (bookmarks come every minute) is dead
MERGE_PATCH = "application/merge-patch+json"

Lister = Callable[..., Awaitable[Any]]


class KubernetesUnavailableError(ConnectionError):
    """The Kubernetes API could not be reached (within the bounded wait)."""


class KubernetesDiscoveryError(RuntimeError):
    """The Kubernetes API refused a request (the message says what to fix)."""


def refused_with(exc: BaseException, status: int) -> bool:
    """Whether `exc` is the API's refusal with HTTP `status`."""
    cause = exc.__cause__
    return isinstance(cause, ApiException) and cause.status == status


class LeaseApi:
    """The API server of one namespace, as discovery uses it."""

    def __init__(self, namespace: str, api: str | None, connect_timeout: float) -> None:
        self.namespace = namespace
        self.api = api
        self.connect_timeout = connect_timeout
        self.where = api or "(not configured yet)"
        self.online = True
        self._client: client.ApiClient | None = None
        self._setup = asyncio.Lock()

    async def _api_client(self) -> client.ApiClient:
        async with self._setup:
            if self._client is None:
                try:
                    configuration = await api_configuration(self.api)
                except KubeConfigError as exc:
                    raise KubernetesDiscoveryError(str(exc)) from exc
                self.where = configuration.host or "(no host)"
                self._client = client.ApiClient(configuration)
            return self._client

    async def _objects(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(await self._api_client())

    async def call(
        self, what: str, request: Callable[[], Awaitable[T]], timeout: float = REQUEST_TIMEOUT_S
    ) -> T:
        """One request, bounded by `timeout`."""
        try:
            async with asyncio.timeout(timeout):
                result = await request()
        except ApiException as exc:
            raise KubernetesDiscoveryError(self._refusal(what, exc)) from exc
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if self.online:
                log.warning("Kubernetes API at %s unreachable (%s): retrying", self.where, exc)
            self.online = False
            raise KubernetesUnavailableError(
                f"Kubernetes API at {self.where} unreachable ({what}): {exc or 'timeout'}"
            ) from exc
        if not self.online:
            log.warning("Kubernetes API at %s is reachable again", self.where)
        self.online = True
        return result

    def _refusal(self, what: str, exc: ApiException) -> str:
        where = f"{ko.PLURAL}.{ko.GROUP} in namespace {self.namespace} at {self.where}"
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

    async def bounded(self, what: str, request: Callable[[], Awaitable[T]]) -> T:
        """Retry an unreachable API for up to `connect_timeout`, then raise."""
        deadline = time.monotonic() + self.connect_timeout
        backoff = Backoff()
        while True:
            try:
                return await self.call(what, request)
            except KubernetesUnavailableError as exc:
                delay = backoff.next()
                if time.monotonic() + delay >= deadline:
                    raise KubernetesUnavailableError(
                        f"{exc} (gave up after {self.connect_timeout:g} s)"
                    ) from exc
            await asyncio.sleep(delay)

    # -- leases ------------------------------------------------------------------------------
    async def list_leases(self, *, retry: bool = True) -> tuple[dict[str, ko.LeaseRecord], str]:
        """The well-formed leases by name, and the list's resourceVersion. `retry`: for up to
        `connect_timeout` while the API is unreachable."""
        api = await self._objects()
        send = self.bounded if retry else self.call
        answer: Any = await send(
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
        return records, _list_version(answer)

    async def create(self, body: dict[str, Any]) -> None:
        api = await self._objects()
        await self.call(
            f"create {body['metadata']['name']}",
            lambda: api.create_namespaced_custom_object(
                ko.GROUP,
                ko.VERSION,
                self.namespace,
                ko.PLURAL,
                body,
                _request_timeout=REQUEST_TIMEOUT_S,
            ),
        )

    async def patch(
        self, name: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S
    ) -> None:
        api = await self._objects()
        await self.call(
            f"patch {name}",
            lambda: api.patch_namespaced_custom_object(  # type: ignore[call-arg]
                ko.GROUP,
                ko.VERSION,
                self.namespace,
                ko.PLURAL,
                name,
                body,
                _content_type=MERGE_PATCH,
                _request_timeout=timeout,
            ),
            timeout,
        )

    async def delete(self, name: str, version: str = "") -> None:
        """Delete a lease's object (only if it is still at resourceVersion `version`, when one is
        given); one that is gone (or changed) already is no error."""
        api = await self._objects()
        options = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(resource_version=version) if version else None
        )
        try:
            await self.call(
                f"delete {name}",
                lambda: api.delete_namespaced_custom_object(
                    ko.GROUP,
                    ko.VERSION,
                    self.namespace,
                    ko.PLURAL,
                    name,
                    body=options,
                    _request_timeout=REQUEST_TIMEOUT_S,
                ),
            )
        except KubernetesDiscoveryError as exc:
            if not (refused_with(exc, 404) or refused_with(exc, 409)):
                raise

    async def watch_leases(self, version: str) -> AsyncIterator[dict[str, Any]]:
        api = await self._objects()

        def lister(**kwargs: Any) -> Awaitable[Any]:
            return api.list_namespaced_custom_object(
                ko.GROUP, ko.VERSION, self.namespace, ko.PLURAL, **kwargs
            )

        async for event in self._stream(f"watch {ko.PLURAL}", lister, version):
            yield event

    # -- pods --------------------------------------------------------------------------------
    async def list_pods(self) -> tuple[dict[str, bool], str]:
        """Every pod's readiness by name, and the list's resourceVersion."""
        core = client.CoreV1Api(await self._api_client())
        response: Any = await self.bounded(
            "list pods",
            lambda: core.list_namespaced_pod(
                self.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
            ),
        )
        answer = json.loads(await self._checked("list pods", response).read())
        pods = {p["metadata"]["name"]: ko.pod_ready(p) for p in answer.get("items") or []}
        return pods, _list_version(answer)

    async def watch_pods(self, version: str) -> AsyncIterator[dict[str, Any]]:
        core = client.CoreV1Api(await self._api_client())

        def lister(**kwargs: Any) -> Awaitable[Any]:
            return core.list_namespaced_pod(self.namespace, **kwargs)

        async for event in self._stream("watch pods", lister, version):
            yield event

    async def _stream(
        self, what: str, lister: Lister, version: str
    ) -> AsyncIterator[dict[str, Any]]:
        """`{"type": "OPEN", "response": ...}` once the watch is open (closing the response ends
        the stream), then its events from `version`, until the server ends it. A watch that
        cannot resume from `version` raises `WatchGoneError`."""
        response = await self.call(
            what,
            lambda: lister(
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
            if response.status == 410:
                raise WatchGoneError(f"{what}: HTTP 410 Gone")
            self._checked(what, response)
            yield {"type": "OPEN", "response": response}
            async for line in response.content:
                if line.strip():
                    event = json.loads(line)
                    if event.get("type") == "ERROR":  # a Status: the watch ends
                        status = event.get("object") or {}
                        if status.get("code") == 410:
                            raise WatchGoneError(f"{what}: {status.get('message', 'Gone')}")
                        raise KubernetesDiscoveryError(
                            f"cannot {what}: {status.get('code')} {status.get('message')}"
                        )
                    yield event
        finally:
            response.release()

    def _checked(self, what: str, response: Any) -> Any:
        """`response`, if the API accepted the request (a raw response, `_preload_content=False`,
        is not checked by the client)."""
        if 200 <= response.status < 300:
            return response
        refusal = ApiException(status=response.status, reason=response.reason)
        raise KubernetesDiscoveryError(self._refusal(what, refusal)) from refusal

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


class WatchGoneError(Exception):
    """A watch cannot resume from its resourceVersion (410 Gone): list again."""


def event_version(event: dict[str, Any]) -> str:
    obj = event.get("object") or {}
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def _list_version(answer: Any) -> str:
    return str((answer.get("metadata") or {}).get("resourceVersion") or "")
