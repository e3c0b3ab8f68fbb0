"""The TCP request plane's listener: one port per process; each accepted socket is a
`ServerConnection` carrying any number of streams."""

from __future__ import annotations

import asyncio
import contextlib

from kvbaton.runtime.request_plane.server import FrameServer, ServerConnection


class TcpRequestServer(FrameServer):
    transport = "tcp"

    _server: asyncio.Server | None = None

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: ServerConnection(self),
            self.settings.host,
            self.settings.port,
            reuse_address=True,
        )
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"tcp://{host}:{port}"
        return self.address

    async def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()

    async def closed(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
