"""The serving side of the request plane, whatever carries its frames: `FrameServer` holds the
routes, the connections and the running streams; a transport (tcp, nats, http) gives it
connections (`ServerConnection` over an asyncio transport) and its address.

A stream's life on this side:
1. `Request` arrives -> refused at once with `Error` if the server drains (SHUTTING_DOWN), the
   endpoint is unknown (NOT_FOUND) or the payload does not decode (BAD_REQUEST);
2. running -> the handler's items go out as `Data`, in order, waiting while the socket is full
   or while the caller has not read enough of what it was sent (its window; see `Credit`);
3. finished -> exactly one `End` (handler returned) or `Error` (handler raised, deadline passed).
A `Cancel`, the connection's loss or the deadline stops the stream: the context turns stopped at
once, nothing more is sent, and the handler's task is cancelled after the grace period unless it
returned first. Shutdown stops taking requests, lets running streams finish for up to the drain
timeout, then cancels what is left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvbaton.protocols.frames import Cancel, Credit, End, Error, ErrorKind, Frame, Request
from kvbaton.runtime.context import Context
from kvbaton.runtime.errors import FrameError
from kvbaton.runtime.request_plane.connection import FrameConnection
from kvbaton.runtime.request_plane.framing import payload_decoder
from kvbaton.runtime.settings import RuntimeSettings

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 1.0  # how long shutdown waits for cancelled handlers and closing sockets
YIELD_EVERY = 64  # responses a stream may send without letting other streams run

Handler = Callable[[Any, Context], AsyncIterator[Any] | Awaitable[Any]]


@dataclass
class Route:
    handler: Handler
    decoder: msgspec.msgpack.Decoder[Any]


@dataclass(eq=False)
class _Stream:
    stream_id: int
    context: Context
    task: asyncio.Task[None] | None = None
    finished: bool = False  # a terminal frame was sent, or the caller is gone
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    credit: int | None = None  # responses it may still send; None: no flow control
    credit_waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        waiter, self.credit_waiter = self.credit_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class ServerConnection(FrameConnection):
    def __init__(self, server: FrameServer) -> None:
        super().__init__(server.settings.max_frame_bytes)
        self.server = server
        self.streams: dict[int, _Stream] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server.connections.add(self)

    def frame_received(self, frame: Frame) -> None:
        # `type(...) is`: exact for frames, and cheaper than isinstance (see ClientConnection).
        if type(frame) is Request:
            self._start(frame)
        elif type(frame) is Cancel:
            stream = self.streams.get(frame.stream_id)
            if stream is not None:
                self.stop(stream)
        elif type(frame) is Credit:
            stream = self.streams.get(frame.stream_id)
            if stream is not None and stream.credit is not None:
                stream.credit += max(0, frame.responses)
                stream.wake()
        else:
            raise FrameError(f"unexpected {type(frame).__name__} frame from a client")

    def connection_closed(self, exc: BaseException | None) -> None:
        self.server.connections.discard(self)
        for stream in list(self.streams.values()):
            self.stop(stream)

    def _refuse(self, frame: Request, kind: ErrorKind, message: str) -> None:
        self.send(Error(frame.stream_id, kind, message))

    def _start(self, frame: Request) -> None:
        if frame.stream_id in self.streams:
            raise FrameError(f"stream id {frame.stream_id} is already open")
        server = self.server
        if server.draining:
            return self._refuse(frame, ErrorKind.SHUTTING_DOWN, "instance is shutting down")
        limit = server.settings.max_streams_per_connection
        if len(self.streams) >= limit:
            return self._refuse(
                frame, ErrorKind.STREAM_LIMIT, f"{limit} streams are open on this connection"
            )
        route = server.routes.get(frame.endpoint)
        if route is None:
            return self._refuse(
                frame, ErrorKind.NOT_FOUND, f"endpoint {frame.endpoint!r} is not served here"
            )
        try:
            request = route.decoder.decode(frame.payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._refuse(frame, ErrorKind.BAD_REQUEST, f"bad request: {exc}")
        stream = _Stream(
            frame.stream_id, Context(frame.request_id, frame.deadline), credit=frame.window or None
        )
        self.streams[frame.stream_id] = stream
        stream.task = asyncio.create_task(self._run(stream, route, request))
        server.tasks.add(stream.task)
        stream.task.add_done_callback(server.tasks.discard)
        if frame.deadline is not None:
            loop = asyncio.get_running_loop()
            stream.timers.append(
                loop.call_at(
                    loop.time() + frame.deadline - time.time(), self._deadline_passed, stream
                )
            )
        return None

    def _finish(self, stream: _Stream, frame: Frame | None) -> None:
        if not stream.finished:
            stream.finished = True
            if frame is not None:
                self.send(frame)

    def _finish_with_error(self, stream: _Stream, message: str, error_type: str) -> None:
        """Send a handler's error; a message too long for a frame is cut (to half the frame
        limit in UTF-8 bytes, so the frame always fits), never dropped."""
        limit = self.max_frame_bytes // 2
        encoded = message.encode("utf-8", "replace")
        if len(encoded) > limit:
            cut = encoded[:limit].decode("utf-8", "ignore")
            message = f"{cut}... [{len(message) - len(cut)} more characters]"
        self._finish(stream, Error(stream.stream_id, ErrorKind.HANDLER, message, error_type[:200]))

    def stop(self, stream: _Stream, frame: Frame | None = None) -> None:
        """Stop a stream: nothing more is sent but `frame`; cancel its task after the grace."""
        self._finish(stream, frame)
        stream.context.stop_generating()
        stream.wake()
        if stream.task is not None and not stream.task.done():
            loop = asyncio.get_running_loop()
            stream.timers.append(
                loop.call_later(self.server.settings.cancel_grace, stream.task.cancel)
            )

    def _deadline_passed(self, stream: _Stream) -> None:
        self.stop(stream, Error(stream.stream_id, ErrorKind.DEADLINE, "deadline exceeded"))

    async def _run(self, stream: _Stream, route: Route, request: Any) -> None:
        sid = stream.stream_id
        try:
            result = route.handler(request, stream.context)
            if isinstance(result, AsyncIterator):
                try:
                    sent = 0
                    async for item in result:
                        if stream.finished:
                            break
                        self.send_data(sid, item)
                        sent += 1
                        if stream.credit is not None:
                            stream.credit -= 1
                            while stream.credit <= 0 and not stream.finished:
                                stream.credit_waiter = asyncio.get_running_loop().create_future()
                                await stream.credit_waiter  # the caller reads slower
                        if self._paused or self.closed:
                            await self.drain()
                        elif sent % YIELD_EVERY == 0:
                            await asyncio.sleep(0)  # a handler that never awaits starves no one
                finally:
                    aclose = getattr(result, "aclose", None)
                    if aclose is not None:
                        await aclose()
            else:
                item = await result
                if not stream.finished:
                    self.send_data(sid, item)
            self._finish(stream, End(sid))
        except asyncio.CancelledError:
            # Cancelled by us (grace over, drain over): the caller is gone or sees the
            # connection close, which it reads as a broken stream.
            stream.finished = True
        except Exception as exc:
            log.warning("handler raised on request %s: %r", stream.context.id, exc)
            self._finish_with_error(stream, str(exc) or repr(exc), type(exc).__name__)
        finally:
            for timer in stream.timers:
                timer.cancel()
            self.streams.pop(sid, None)


class FrameServer:
    """Serves the routes of one process; a subclass listens on its transport.

    `transport` names the request plane; `address` is set by `start()`."""

    transport = ""

    def __init__(self, settings: RuntimeSettings) -> None:
        self.settings = settings
        self.routes: dict[str, Route] = {}
        self.connections: set[ServerConnection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.draining = False
        self.address = ""

    async def start(self) -> str:
        raise NotImplementedError

    async def stop_listening(self) -> None:
        """Take no new connections (those open stay until `shutdown` closes them)."""

    async def closed(self) -> None:
        """Release what the transport holds, once every connection is closed."""

    def add_route(self, path: str, handler: Handler, request_type: Any = Any) -> None:
        if path in self.routes:
            raise ValueError(f"endpoint {path!r} is already served by this process")
        self.routes[path] = Route(handler, payload_decoder(request_type))

    def remove_route(self, path: str) -> None:
        self.routes.pop(path, None)

    async def shutdown(self, drain_timeout: float | None = None) -> None:
        """Stop accepting, let in-flight streams finish up to the timeout, then cancel them."""
        timeout = self.settings.drain_timeout if drain_timeout is None else drain_timeout
        self.draining = True
        await self.stop_listening()
        if self.tasks:
            _, pending = await asyncio.wait(set(self.tasks), timeout=timeout)
            if pending:
                log.warning(
                    "cancelling %d streams still running after %.1fs of draining",
                    len(pending),
                    timeout,
                )
                for task in pending:
                    task.cancel()
                _, stuck = await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
                if stuck:  # a handler that swallows cancellation does not hold shutdown up
                    log.error("%d handlers ignored cancellation; leaving them", len(stuck))
        for conn in list(self.connections):
            conn.close(abort_after=CANCEL_WAIT_S)
        await self.closed()
