"""A framed connection over an asyncio transport, shared by the server and client sides.

Outgoing frames are coalesced: `send` queues the encoded frame and the queue is written once per
event-loop iteration, so many concurrent streams cost one write syscall, not one each. `drain`
waits while the transport's buffer is over its high-water mark.
"""

from __future__ import annotations

import asyncio
import logging
from typing import cast

from kvbaton.protocols.frames import Frame
from kvbaton.runtime.errors import FrameError, StreamBrokenError
from kvbaton.runtime.request_plane.framing import FrameDecoder, encode_frame

log = logging.getLogger(__name__)


class FrameConnection(asyncio.Protocol):
    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._decoder = FrameDecoder(max_frame_bytes)
        self._transport: asyncio.Transport | None = None
        self._pending: list[bytes] = []
        self._flush_scheduled = False
        self._paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.peer = "?"

    # -- subclass hooks ----------------------------------------------------------------------
    def frame_received(self, frame: Frame) -> None:
        raise NotImplementedError

    def connection_closed(self, exc: BaseException | None) -> None:
        """Called once when the connection is gone, whatever the cause."""

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._decoder.feed(data)
            for frame in frames:
                self.frame_received(frame)
        except FrameError as exc:
            self.abort(f"{exc}")

    def eof_received(self) -> bool | None:
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._decoder.buffered:
            log.error(
                "connection %s closed inside a frame (%d bytes held back)",
                self.peer,
                self._decoder.buffered,
            )
        self._wake_drain(StreamBrokenError(f"connection to {self.peer} lost"))
        self.connection_closed(exc)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drain(None)

    # -- sending -----------------------------------------------------------------------------
    def send(self, frame: Frame) -> None:
        """Queue a frame; raises FrameError if it is over the size limit. A no-op once closed."""
        data = encode_frame(frame, self.max_frame_bytes)
        if self.closed or self._transport is None:
            return
        self._pending.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        if pending and not self.closed and self._transport is not None:
            self._transport.write(b"".join(pending) if len(pending) > 1 else pending[0])

    async def drain(self) -> None:
        """Wait until the transport accepts more; raises StreamBrokenError once closed."""
        if self.closed:
            raise StreamBrokenError(f"connection to {self.peer} lost")
        if not self._paused:
            return
        if self._drain_waiter is None:
            self._drain_waiter = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._drain_waiter)

    def _wake_drain(self, exc: BaseException | None) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)
                waiter.exception()  # retrieved: no "never retrieved" warning if nobody waits

    def abort(self, reason: str) -> None:
        """Close at once, dropping what is queued: for protocol errors."""
        log.error("closing connection %s: %s", self.peer, reason)
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        """Close after writing what is queued."""
        self._flush()
        if self._transport is not None:
            self._transport.close()
