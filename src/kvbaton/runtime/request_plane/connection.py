"""A framed connection over an asyncio transport, shared by the server and client sides.

Outgoing frames are coalesced:
- `send` queues the encoded frame; the queue is written two event-loop turns after the first
  frame joined it. So many concurrent streams cost one write syscall, not one each, and so do a
  stream's outputs that a fast engine sends on consecutive turns (one step's, then the next's).
- Responses given to `send_data` before a write go out in it as one `Data` frame per stream (up
  to the frame size limit), ahead of any later frame of that stream.
- Once more than FLUSH_BYTES are queued they are written at once, so the transport's flow control
  (`pause_writing`) can push back; `drain` waits while the transport's buffer is over its
  high-water mark.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import msgspec

from kvbaton.protocols.frames import Data, Frame
from kvbaton.runtime.errors import FrameError, StreamBrokenError
from kvbaton.runtime.request_plane.framing import (
    DATA_OVERHEAD,
    FrameDecoder,
    encode_frame_into,
    encode_payload,
)

log = logging.getLogger(__name__)

FLUSH_BYTES = 256 * 1024


class FrameConnection(asyncio.Protocol):
    loop: asyncio.AbstractEventLoop  # set when connected

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._decoder = FrameDecoder(max_frame_bytes)
        self._transport: asyncio.Transport | None = None
        self._out = bytearray()
        self._data: dict[int, tuple[list[msgspec.Raw], int]] = {}  # stream -> (payloads, bytes)
        self._queued = 0  # bytes in _out and _data
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
        self.loop = asyncio.get_running_loop()
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
        if self.closed or self._transport is None:
            return
        if frame.stream_id in self._data:
            self._emit_data(frame.stream_id)
        before = len(self._out)
        encode_frame_into(frame, self._out, self.max_frame_bytes)
        self._queued += len(self._out) - before
        self._schedule_flush()

    def send_data(self, stream_id: int, value: Any) -> None:
        """Queue one response of a stream. Raises TypeError if msgpack cannot hold `value`, and
        FrameError if it is over the size limit. A no-op once closed."""
        raw = encode_payload(value)
        if len(raw) + DATA_OVERHEAD > self.max_frame_bytes:
            raise FrameError(
                f"response of {len(raw)} bytes is over the frame limit of "
                f"{self.max_frame_bytes} bytes"
            )
        if self.closed or self._transport is None:
            return
        batch = self._data.get(stream_id)
        if batch is not None and batch[1] + len(raw) + DATA_OVERHEAD > self.max_frame_bytes:
            self._emit_data(stream_id)
            batch = None
        if batch is None:
            self._data[stream_id] = ([raw], len(raw))
        else:
            batch[0].append(raw)
            self._data[stream_id] = (batch[0], batch[1] + len(raw))
        self._queued += len(raw)
        self._schedule_flush()

    def _emit_data(self, stream_id: int) -> None:
        payloads, _ = self._data.pop(stream_id)
        encode_frame_into(Data(stream_id, payloads), self._out, self.max_frame_bytes)

    def _schedule_flush(self) -> None:
        if self._queued > FLUSH_BYTES:
            self._flush()
        elif not self._flush_scheduled:
            self.loop.call_soon(self._flush_next_turn)
            self._flush_scheduled = True

    def _flush_next_turn(self) -> None:
        """One turn on: what the tasks woken meanwhile send joins the write."""
        self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        for stream_id in list(self._data):
            self._emit_data(stream_id)
        out, self._out = self._out, bytearray()
        self._queued = 0
        if out and not self.closed and self._transport is not None:
            self._transport.write(out)

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

    def close(self, abort_after: float | None = None) -> None:
        """Close after writing what is queued; abort if still open `abort_after` seconds on
        (a peer that stops reading must not keep the socket forever)."""
        self._flush()
        if self._transport is not None:
            self._transport.close()
            if abort_after is not None:
                self.loop.call_later(abort_after, self._abort_if_open)

    def _abort_if_open(self) -> None:
        if not self.closed:
            self.abort("the peer did not take the last frames in time")
