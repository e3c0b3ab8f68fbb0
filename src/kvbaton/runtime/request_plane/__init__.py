"""Request planes: how a request and its stream of responses travel between processes.

Every plane carries the same frames (protocols/frames.py) with the same semantics; only the
carrier differs: `tcp` (a multiplexed connection per peer), `nats` (messages through a NATS
server), `http` (one POST per request, the responses in its streamed body). A process serves on
one plane (its settings') and calls an instance on whichever plane the instance's address names.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlparse

import msgspec

from kvbaton.runtime.errors import ConnectError
from kvbaton.runtime.request_plane.server import FrameServer, Handler
from kvbaton.runtime.request_plane.stream import Stream
from kvbaton.runtime.request_plane.tcp_client import TcpRequestClient
from kvbaton.runtime.request_plane.tcp_server import TcpRequestServer
from kvbaton.runtime.settings import RuntimeSettings

if TYPE_CHECKING:
    from kvbaton.runtime.nats_connections import NatsConnections

__all__ = [
    "FrameServer",
    "Handler",
    "RequestClients",
    "Stream",
    "TcpRequestClient",
    "TcpRequestServer",
    "make_request_server",
]


class PlaneClient(Protocol):
    """What each plane's client offers (TcpRequestClient is one)."""

    async def open_stream(
        self,
        address: str,
        endpoint: str,
        payload: msgspec.Raw,
        *,
        request_id: str,
        deadline: float | None = None,
        response_type: Any = Any,
    ) -> Stream: ...

    def connections(self) -> list[str]:
        """Peer addresses with an open connection."""

    def open_streams(self) -> int:
        """Streams open on this plane's connections (sent, not yet ended or cancelled)."""

    async def close(self) -> None: ...


def make_request_server(settings: RuntimeSettings, nats: NatsConnections) -> FrameServer:
    """The server of the plane the settings name."""
    if settings.request_plane == "nats":
        from kvbaton.runtime.request_plane.nats_plane import NatsRequestServer

        return NatsRequestServer(settings, nats)
    if settings.request_plane == "http":
        from kvbaton.runtime.request_plane.http_server import HttpRequestServer

        return HttpRequestServer(settings)
    return TcpRequestServer(settings)


@functools.lru_cache(maxsize=1024)
def scheme_of(address: str) -> str:
    """The address's URL scheme (parsed once per address: it is asked once per request)."""
    return urlparse(address).scheme


class RequestClients:
    """The calling side of every plane, each made on first use; picks by the address's scheme
    (`tcp://`, `nats://`, `http://`)."""

    def __init__(self, settings: RuntimeSettings, nats: NatsConnections) -> None:
        self.settings = settings
        self._nats = nats
        self._planes: dict[str, PlaneClient] = {"tcp": TcpRequestClient(settings)}

    def plane(self, scheme: str) -> PlaneClient:
        client = self._planes.get(scheme)
        if client is None:
            if scheme == "nats":
                from kvbaton.runtime.request_plane.nats_plane import NatsRequestClient

                client = NatsRequestClient(self.settings, self._nats)
            elif scheme == "http":
                from kvbaton.runtime.request_plane.http_client import HttpRequestClient

                client = HttpRequestClient(self.settings)
            else:
                raise ConnectError(f"no request plane for scheme {scheme!r}")
            self._planes[scheme] = client
        return client

    def open_stream(
        self,
        address: str,
        endpoint: str,
        payload: msgspec.Raw,
        *,
        request_id: str,
        deadline: float | None = None,
        response_type: Any = Any,
    ) -> Awaitable[Stream]:
        """Send a request; raises ConnectError if the peer cannot be reached (nothing sent).
        The plane's own coroutine, with none of this layer's around it (one per request)."""
        return self.plane(scheme_of(address)).open_stream(
            address,
            endpoint,
            payload,
            request_id=request_id,
            deadline=deadline,
            response_type=response_type,
        )

    def connections(self) -> list[str]:
        """Peer addresses with an open connection, on every plane."""
        return [a for client in self._planes.values() for a in client.connections()]

    def open_streams(self) -> int:
        return sum(client.open_streams() for client in self._planes.values())

    async def close(self) -> None:
        for client in self._planes.values():
            await client.close()
