"""DistributedRuntime -> Namespace -> Component -> Endpoint: the face every process uses.

A runtime owns at most one discovery lease (granted when it first serves; its id is the
`instance_id` of everything it serves), one request-plane server and one pool of client
connections. `shutdown()` (also on leaving `async with`) deregisters, stops accepting, drains
in-flight streams up to `drain_timeout`, cancels the rest and closes connections.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from types import TracebackType
from typing import Any

from kvbaton.protocols.discovery import Instance
from kvbaton.runtime.client import Client
from kvbaton.runtime.discovery import Discovery, open_discovery
from kvbaton.runtime.errors import RuntimeShutDownError
from kvbaton.runtime.names import EndpointPath, check_name
from kvbaton.runtime.nats_connections import NatsConnections
from kvbaton.runtime.request_plane import (
    FrameServer,
    Handler,
    RequestClients,
    make_request_server,
)
from kvbaton.runtime.settings import RuntimeSettings
from kvbaton.runtime.system_server import SystemServer

log = logging.getLogger(__name__)


class DistributedRuntime:
    def __init__(
        self,
        discovery: str | Discovery | None = None,
        *,
        settings: RuntimeSettings | None = None,
        **overrides: Any,
    ) -> None:
        """`discovery` is a URL (`file:///dir`, `mem://name`) or a Discovery object; keyword
        overrides are RuntimeSettings fields and win over `KVBATON_*` variables."""
        if isinstance(discovery, str):
            overrides["discovery"] = discovery
        self.settings = settings or RuntimeSettings(**overrides)
        if settings is not None and overrides:
            self.settings = settings.model_copy(update=overrides)
        self.discovery: Discovery = (
            discovery
            if isinstance(discovery, Discovery)
            else open_discovery(self.settings.discovery)
        )
        self.nats = NatsConnections(self.settings)
        """This process's NATS connections (nats request plane, nats event plane)."""
        self.request_client = RequestClients(self.settings, self.nats)
        self._server: FrameServer | None = None
        self._lease_id: int | None = None
        self._setup_lock = asyncio.Lock()
        self._clients: list[Client] = []
        self._stopped = asyncio.Event()
        self._closed = False
        self._served: set[str] = set()  # the endpoints registered now
        self._system: SystemServer | None = None

    async def __aenter__(self) -> DistributedRuntime:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    # -- naming ------------------------------------------------------------------------------
    def namespace(self, name: str) -> Namespace:
        return Namespace(self, check_name("namespace", name))

    def endpoint(self, path: str) -> Endpoint:
        """`runtime.endpoint("ns.component.endpoint")`."""
        return Endpoint(self, EndpointPath.parse(path))

    # -- serving -----------------------------------------------------------------------------
    @property
    def instance_id(self) -> int | None:
        """The lease id of this process once it serves something, else None."""
        return self._lease_id

    async def _serving_setup(self) -> tuple[FrameServer, int]:
        async with self._setup_lock:  # shutdown takes it too: no setup outlives a shutdown
            if self._closed:
                raise RuntimeShutDownError("the runtime is shut down")
            if self._server is None:
                server = make_request_server(self.settings, self.nats)
                await server.start()
                self._server = server
            if self._lease_id is None:
                self._lease_id = await self.discovery.grant_lease(self.settings.lease_ttl)
            return self._server, self._lease_id

    async def _register(
        self,
        path: EndpointPath,
        handler: Handler,
        request_type: Any,
        metadata: dict[str, Any] | None,
    ) -> str:
        server, lease_id = await self._serving_setup()
        server.add_route(str(path), handler, request_type)
        instance = Instance(
            namespace=path.namespace,
            component=path.component,
            endpoint=path.endpoint,
            instance_id=lease_id,
            address=server.address,
            transport=server.transport,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            registered_at=time.time(),
            metadata=metadata or {},
        )
        key = path.key(lease_id)
        await self.discovery.put(key, instance.to_json(), lease_id)
        self._served.add(str(path))
        log.info("serving %s as instance %x at %s", path, lease_id, server.address)
        return key

    async def ensure_instance_id(self) -> int:
        """This process's instance id (its lease), granting the lease and starting the
        request-plane server if nothing is served yet."""
        _, lease_id = await self._serving_setup()
        return lease_id

    async def publish(self, key: str, value: bytes) -> None:
        """Store `key` in discovery, owned by this process's lease: it lives while the process
        does and vanishes with it (used for records beside endpoints, e.g. model cards)."""
        _, lease_id = await self._serving_setup()
        await self.discovery.put(key, value, lease_id)

    async def _deregister(self, path: EndpointPath, key: str) -> None:
        self._served.discard(str(path))
        if not self._closed:
            await self.discovery.delete(key)
        if self._server is not None:
            self._server.remove_route(str(path))

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Ready while serving at least one endpoint and not shutting down (what this process
        knows of itself, not what discovery shows)."""
        endpoints = sorted(self._served)
        if self._closed:
            return False, {"status": "stopping", "endpoints": endpoints}
        if not endpoints:
            return False, {"status": "starting", "endpoints": []}
        return True, {"status": "ready", "endpoints": endpoints}

    def start_system_server(self) -> str:
        """Serve /live, /health and /metrics at `settings.system_port` until shutdown ends;
        returns its URL."""
        if self._system is None:
            port = self.settings.system_port or 0
            self._system = SystemServer(self.settings.host, port, self.health)
            self._system.start()
        return self._system.url

    async def wait_for_shutdown(self) -> None:
        await self._stopped.wait()

    async def drained(self) -> None:
        """Once shutting down: return when the streams this process serves have ended (or the
        drain timeout passed), so that what they need (an engine) can be stopped after them."""
        server = self._server
        if server is None:
            return
        tasks = {t for t in server.tasks if t is not asyncio.current_task()}
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.drain_timeout)

    async def shutdown(self) -> None:
        """Graceful: deregister, stop accepting, drain, cancel the rest, close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:  # from now on new streams are refused (retryable), never
            self._server.draining = True  # routed to a removed endpoint while leases go
        self._stopped.set()
        async with self._setup_lock:
            await self._close_all()

    async def _close_all(self) -> None:
        try:
            for client in list(self._clients):
                await client.close()
            if self._lease_id is not None:
                try:
                    await self.discovery.revoke_lease(self._lease_id)
                except Exception as exc:  # keys then expire with the lease; go on closing
                    log.error("could not revoke lease %x: %s", self._lease_id, exc)
            if self._server is not None:
                await self._server.shutdown()
        finally:
            try:
                await self.request_client.close()
                await self.discovery.close()
                await self.nats.close()
            finally:
                if self._system is not None:
                    await self._system.stop()


class Namespace:
    def __init__(self, runtime: DistributedRuntime, name: str) -> None:
        self.runtime = runtime
        self.name = name

    def component(self, name: str) -> Component:
        return Component(self, check_name("component", name))


class Component:
    def __init__(self, namespace: Namespace, name: str) -> None:
        self.namespace = namespace
        self.name = name

    def endpoint(self, name: str) -> Endpoint:
        path = EndpointPath(self.namespace.name, self.name, check_name("endpoint", name))
        return Endpoint(self.namespace.runtime, path)


class Endpoint:
    def __init__(self, runtime: DistributedRuntime, path: EndpointPath) -> None:
        self.runtime = runtime
        self.path = path

    @property
    def name(self) -> str:
        return self.path.endpoint

    async def serve_endpoint(
        self, handler: Handler, *, request_type: Any = Any, metadata: dict[str, Any] | None = None
    ) -> None:
        """Serve `handler` (an async generator function, or an async function for one
        response) and register in discovery; returns when the runtime shuts down. Cancelling
        it deregisters the endpoint; streams already running go on to their end."""
        key = await self.runtime._register(self.path, handler, request_type, metadata)
        try:
            await self.runtime.wait_for_shutdown()
        finally:
            await asyncio.shield(self.runtime._deregister(self.path, key))

    async def client(self, *, response_type: Any = Any) -> Client:
        client = Client(self.runtime, self.path, response_type)
        await client._start()
        self.runtime._clients.append(client)
        return client
