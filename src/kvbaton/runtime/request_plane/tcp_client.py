"""The TCP request plane's client: one pooled connection per peer address."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlparse

import msgspec

from kvbaton.runtime.errors import ConnectError
from kvbaton.runtime.request_plane.framing import payload_decoder
from kvbaton.runtime.request_plane.stream import (
    ClientConnection,
    ConnectionsByAddress,
    Dials,
    Stream,
)
from kvbaton.runtime.settings import RuntimeSettings


class TcpRequestClient(ConnectionsByAddress):
    """Pool of client connections, one per peer address."""

    def __init__(self, settings: RuntimeSettings) -> None:
        super().__init__(settings)
        self._connect = Dials(self._dial)

    async def open_stream(
        self,
        address: str,
        endpoint: str,
        payload: msgspec.Raw,
        *,
        request_id: str,
        deadline: float | None = None,
        response_type: Any = Any,
    ) -> Stream:
        """Send a request; raises ConnectError if the peer cannot be reached (nothing sent)."""
        conn = self._conns.get(address)
        if conn is None or conn.closed:
            conn = await self._connect(address)
        return conn.open(endpoint, payload, request_id, deadline, payload_decoder(response_type))

    async def _dial(self, address: str) -> ClientConnection:
        parsed = urlparse(address)
        if parsed.scheme != "tcp" or parsed.hostname is None or parsed.port is None:
            raise ConnectError(f"not a tcp address: {address!r}")
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: ClientConnection(self, address), parsed.hostname, parsed.port
                ),
                self.settings.connect_timeout,
            )
        except (OSError, TimeoutError) as exc:
            raise ConnectError(f"cannot connect to {address}: {exc or 'timed out'}") from exc
        self._conns[address] = conn
        return conn

    async def close(self) -> None:
        self._connect.cancel()
        for conn in list(self._conns.values()):
            conn.close()
        self._conns.clear()
