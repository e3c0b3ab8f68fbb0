"""The Kubernetes connector: one apps/v1 Deployment per role, scaled through `spec.replicas`.

`current()` reads each Deployment's `spec.replicas` (what is asked for, not the ready pods: a
decision already requested is not requested again); `scale()` patches the Deployment with
`{"spec": {"replicas": N}}` (a strategic merge patch, as `kubectl patch` sends: on this scalar
field the same as a JSON merge patch; RBAC verb `patch` on `deployments`; the same change as
`kubectl scale`, which goes through the `scale` subresource). Pods then start or stop as the
Deployment controller does it: a stopped pod gets SIGTERM, so a kvbaton worker deregisters and
drains its in-flight streams within the pod's terminationGracePeriodSeconds.

The API is found as `kvbaton.runtime.kube_api` says (`host`, a kubeconfig, the pod's service
account). Every request is bounded by `request_timeout`; a missing
Deployment raises DeploymentNotFoundError, an API that cannot be reached
KubernetesUnreachableError, any other refusal KubernetesApiError (all ConnectorErrors).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from kvbaton.planner.connectors import ROLES, ConnectorError, check_replicas
from kvbaton.runtime.kube_api import KubeConfigError, api_configuration

log = logging.getLogger(__name__)

T = TypeVar("T")

REQUEST_TIMEOUT_S = 10.0


class DeploymentNotFoundError(ConnectorError):
    pass


class KubernetesUnreachableError(ConnectorError):
    pass


class KubernetesApiError(ConnectorError):
    pass


class KubernetesConnector:
    def __init__(
        self,
        namespace: str,
        deployments: Mapping[str, str],
        *,
        host: str | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        request_timeout: float = REQUEST_TIMEOUT_S,
    ) -> None:
        """`deployments`: role -> the name of its Deployment in `namespace`, e.g.
        `{"prefill": "kvbaton-prefill", "decode": "kvbaton-decode"}`."""
        if not deployments:
            raise ValueError("no Deployments given (role -> Deployment name)")
        if request_timeout <= 0:
            raise ValueError("request_timeout must be positive")
        self.namespace = namespace
        self.deployments = dict(deployments)
        self.host = host
        self.kubeconfig = kubeconfig
        self.context = context
        self.request_timeout = request_timeout
        self._api_client: client.ApiClient | None = None
        self._apps: client.AppsV1Api | None = None
        self._where = host or "(not configured yet)"
        self._lock = asyncio.Lock()

    async def current(self) -> dict[str, int]:
        counts = {role: 0 for role in ROLES}
        roles = list(self.deployments)
        replicas = await asyncio.gather(*(self._read(role) for role in roles))
        counts.update(zip(roles, replicas, strict=True))
        return counts

    async def scale(self, role: str, replicas: int) -> None:
        if not check_replicas(role, replicas, self.deployments):
            return
        apps = await self._api()
        name = self.deployments[role]
        body = {"spec": {"replicas": replicas}}
        await self._call(
            role,
            f"scale to {replicas}",
            lambda: apps.patch_namespaced_deployment(
                name, self.namespace, body, _request_timeout=self.request_timeout
            ),
        )
        log.info("kubernetes: %s (%s/%s) scaled to %d", role, self.namespace, name, replicas)

    async def close(self) -> None:
        async with self._lock:
            if self._api_client is not None:
                await self._api_client.close()
            self._api_client = None
            self._apps = None

    # -- inside

    async def _read(self, role: str) -> int:
        apps = await self._api()
        name = self.deployments[role]
        deployment = await self._call(
            role,
            "read",
            lambda: apps.read_namespaced_deployment(
                name, self.namespace, _request_timeout=self.request_timeout
            ),
        )
        spec = deployment.spec
        # An unset spec.replicas means 1 (the API server defaults it).
        return spec.replicas if spec is not None and spec.replicas is not None else 1

    async def _call(self, role: str, what: str, request: Callable[[], Awaitable[T]]) -> T:
        """One API request, bounded by `request_timeout`, its failures as ConnectorErrors."""
        deployment = f"Deployment {self.namespace}/{self.deployments[role]} ({role})"
        try:
            async with asyncio.timeout(self.request_timeout):
                return await request()
        except ApiException as exc:
            if exc.status == 404:
                raise DeploymentNotFoundError(
                    f"{deployment} not found at {self._where} (cannot {what})"
                ) from exc
            raise KubernetesApiError(
                f"{deployment}: cannot {what}: HTTP {exc.status} {exc.reason}: {_message(exc)}"
            ) from exc
        except TimeoutError as exc:
            raise KubernetesUnreachableError(
                f"Kubernetes API at {self._where} did not answer within "
                f"{self.request_timeout:g}s ({deployment}: {what})"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise KubernetesUnreachableError(
                f"Kubernetes API at {self._where} unreachable ({deployment}: {what}): {exc}"
            ) from exc

    async def _api(self) -> client.AppsV1Api:
        async with self._lock:
            if self._apps is None:
                configuration = await self._configuration()
                self._where = configuration.host or "(no host)"
                self._api_client = client.ApiClient(configuration)
                self._apps = client.AppsV1Api(self._api_client)
            return self._apps

    async def _configuration(self) -> client.Configuration:
        try:
            return await api_configuration(self.host, self.kubeconfig, self.context)
        except KubeConfigError as exc:
            raise ConnectorError(str(exc)) from exc


def _message(exc: ApiException) -> str:
    """The message of the API server's Status answer, else its body as text."""
    body: Any = exc.body
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    try:
        status = json.loads(body) if isinstance(body, str) else None
    except ValueError:
        status = None
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return str(body or "")[:300]
