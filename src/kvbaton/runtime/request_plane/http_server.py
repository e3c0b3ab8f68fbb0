"""The HTTP request plane: one POST per request; the stream's responses in its response body.

Both bodies carry the tcp plane's frames, framed the same way, and both sides reuse the tcp
plane's connection classes over virtual transports, so the semantics are tcp's:

- the POST's body (chunked) starts with the stream's `Request` frame and stays open for the
  caller's later frames: `Credit` (flow control, as on tcp). The response (200, chunked) is
  the stream's frames: `Data`... then `End` or `Error`. A refusal (draining, unknown endpoint,
  undecodable payload) is an `Error` frame in a 200 response, as on tcp.
- server: uvicorn (httptools) runs a bare ASGI callable; one `ServerConnection` per POST. Its
  writes become `http.response.body` chunks, sent by the request's own ASGI task (no task per
  chunk), and the response ends once the stream has ended. The headers go out before the
  handler starts. The caller going away (`http.disconnect`) is the connection's loss: the
  handler is stopped, as on a tcp cancel. While a chunk waits in `send` (a slow reader) the
  connection is paused, so the handler waits too.
- client: a lean HTTP/1.1 client on asyncio and httptools: per peer, a pool of keep-alive
  connections, one per concurrent stream, idle ones reused. (httpx was measured first: its
  pool's bookkeeping grows with requests x connections, 41 s for 500 concurrent streams.) One
  `ClientConnection` per POST; `open_stream` returns once the response headers are in, so a
  peer that cannot be reached raises ConnectError and nothing ran. The response body is parsed
  in the socket's read callback straight into the connection; its end is the connection's loss
  (without `End`/`Error` first: StreamBrokenError). `Cancel` closes the HTTP connection, which
  the server sees as a disconnect.
- limits: a body whose first frame is over `max_frame_bytes` is refused with 413, one that does
  not start with a `Request` frame with 400 (the text says why), before anything runs.
- shutdown: the server accepts while it drains (new requests get SHUTTING_DOWN), then stops
  uvicorn, bounded.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

from kvbaton.protocols.frames import Frame, Request
from kvbaton.runtime.errors import (
    FrameError,
)
from kvbaton.runtime.http_embed import EmbeddedUvicorn, listen
from kvbaton.runtime.request_plane.framing import HEADER, FrameDecoder
from kvbaton.runtime.request_plane.http_wire import CONTENT_TYPE, PATH, too_big
from kvbaton.runtime.request_plane.server import CANCEL_WAIT_S, FrameServer, ServerConnection

log = logging.getLogger(__name__)

HIGH_WATER = 256 * 1024  # response bytes waiting for `send` before the handler is paused
LOW_WATER = 64 * 1024  # ... and at which it goes on
SERVER_KEEPALIVE_S = 65.0  # longer: the client, not the server, gives up idle connections
STOP_S = 5.0  # bound on stopping uvicorn once every stream is closed
READ_ON_AFTER_S = 0.005  # a response not over by then starts reading the rest of the request

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", CONTENT_TYPE)],
}
_LAST = {"type": "http.response.body", "body": b"", "more_body": False}


class _ResponseTransport(asyncio.Transport):
    """What one POST's `ServerConnection` writes to: the response body.

    `write` only queues; `pump` (run by the request's ASGI task) sends what is queued as body
    chunks, coalesced, until the stream has ended (`stream_done`), `close` or `abort`. Once the
    response is under way, a task reads the rest of the request body (the caller's frames) and
    then waits for the caller to go away."""

    def __init__(
        self, conn: ServerConnection, peer: Any, receive: Receive, decoder: FrameDecoder
    ) -> None:
        super().__init__({"peername": peer})
        self._conn = conn
        self._receive = receive
        self._decoder = decoder
        self._chunks: list[bytes | bytearray] = []
        self._queued = 0  # bytes written and not yet sent
        self._paused = False  # the connection was told to pause
        self._waiter: asyncio.Future[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._reader_timer: asyncio.TimerHandle | None = None
        self._closing = False  # send what is queued, then end the response
        self._ended = False  # the stream ended and its last frame was written
        self._aborted = False  # stop now, leaving the response incomplete
        self._done = False

    # -- asyncio.Transport, as the connection uses it ----------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self._aborted:
            return
        self._chunks.append(data if not isinstance(data, memoryview) else bytes(data))
        self._queued += len(data)
        if self._queued > HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.pause_writing()
        self._wake()

    def close(self) -> None:
        self._closing = True
        self._wake()

    def abort(self) -> None:
        self._aborted = True
        self._wake()

    def is_closing(self) -> bool:
        return self._closing or self._aborted or self._done

    # -- driving the response ----------------------------------------------------------------
    def stream_done(self, _: object = None) -> None:
        """The stream's task ended. Its last frame is written by now: that frame's flush was
        scheduled before the task's done callbacks."""
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _start_reading(self) -> None:
        """Read the rest of the request: started once the first chunk goes out, or once the
        response is not over after a moment (a unary call that answers at once needs none)."""
        if self._reader_timer is not None:
            self._reader_timer.cancel()
            self._reader_timer = None
        if self._reader is None and not self._done:
            self._reader = asyncio.get_running_loop().create_task(self._read_on())

    async def _read_on(self) -> None:
        """The rest of the request body: the caller's frames; then wait for its going away."""
        conn = self._conn
        while True:
            message = await self._receive()
            if message["type"] != "http.request":
                break
            body = message.get("body")
            if body:
                try:
                    for frame in self._decoder.feed(body):
                        _later_frame(conn, frame)
                except FrameError as exc:
                    conn.abort(f"{exc}")
                    return
        self.abort()  # the caller went away: the response ends here, the handler is stopped

    async def pump(self, send: Send) -> bool:
        """Send the response body; True once it is complete, False if cut short."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                if self._chunks and not self._aborted:
                    chunks, self._chunks = self._chunks, []
                    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                    last = self._closing or self._ended
                    if not last and self._reader is None:
                        self._start_reading()
                    await send({"type": "http.response.body", "body": body, "more_body": not last})
                    self._queued -= len(body)
                    if self._paused and self._queued <= LOW_WATER:
                        self._paused = False
                        self._conn.resume_writing()
                    if last:
                        return True
                elif self._aborted:
                    return False  # uvicorn closes the connection: the caller sees it broken
                elif self._closing or self._ended:
                    await send(_LAST)
                    return True
                else:
                    if self._reader is None and self._reader_timer is None:
                        self._reader_timer = loop.call_later(READ_ON_AFTER_S, self._start_reading)
                    self._waiter = loop.create_future()
                    await self._waiter
                    self._waiter = None
        finally:
            self._done = True
            if self._reader_timer is not None:
                self._reader_timer.cancel()
            if self._reader is not None and not self._reader.done():
                self._reader.cancel()
            if self._paused:  # a handler held back by a reader that is gone goes on
                self._paused = False
                self._conn.resume_writing()


def _later_frame(conn: ServerConnection, frame: Frame) -> None:
    if isinstance(frame, Request):
        raise FrameError("a POST carries one Request frame")
    conn.frame_received(frame)


class _Uvicorn(EmbeddedUvicorn):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.ready.done():
            self.ready.set_result(None)


async def _reply(send: Send, status: int, text: str, *, close: bool) -> None:
    """A plain-text refusal; `close` when the rest of the body is left unread."""
    body = text.encode("utf-8", "replace")
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class HttpRequestServer(FrameServer):
    transport = "http"

    _server: asyncio.Server | None = None  # the listener, as on tcp
    _uvicorn: _Uvicorn | None = None
    _serving: asyncio.Task[None] | None = None

    async def start(self) -> str:
        sock = listen(self.settings.host, self.settings.port)
        config = uvicorn.Config(
            self._asgi,
            http="httptools",
            ws="none",
            lifespan="off",
            interface="asgi3",
            log_config=None,
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            server_header=False,
            date_header=False,
            timeout_keep_alive=int(SERVER_KEEPALIVE_S),
            timeout_graceful_shutdown=max(1, int(CANCEL_WAIT_S)),
        )
        server = self._uvicorn = _Uvicorn(config)
        self._serving = asyncio.create_task(server.serve(sockets=[sock]))
        await asyncio.wait({server.ready, self._serving}, return_when=asyncio.FIRST_COMPLETED)
        if not server.ready.done():
            sock.close()
            self._serving.result()  # raises what stopped it
            raise RuntimeError("the HTTP request plane's server stopped while starting")
        self._server = server.servers[0]
        host, port = sock.getsockname()[:2]
        self.address = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        return self.address

    async def closed(self) -> None:
        server, serving = self._uvicorn, self._serving
        if server is None or serving is None:
            return
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(serving), STOP_S)
        except TimeoutError:
            log.error("the HTTP request plane's server did not stop in %.0fs", STOP_S)
            server.force_exit = True
            serving.cancel()
        except Exception as exc:
            log.error("the HTTP request plane's server failed: %r", exc)

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != PATH:
            return await _reply(send, 404, f"no {scope['path']} here (POST {PATH})", close=False)
        if scope["method"] != "POST":
            return await _reply(send, 405, f"{scope['method']}: only POST {PATH}", close=False)
        opening = await self._read_request(scope, receive, send)
        if opening is None:
            return None
        request, later, decoder = opening
        # The headers leave before the handler starts: no headers, nothing ran.
        await send(_START)
        conn = ServerConnection(self)
        transport = _ResponseTransport(conn, scope.get("client"), receive, decoder)
        conn.connection_made(transport)
        task: asyncio.Task[None] | None = None
        complete = False
        try:
            conn.frame_received(request)
            try:
                for frame in later:
                    _later_frame(conn, frame)
            except FrameError as exc:
                conn.abort(f"{exc}")
            stream = conn.streams.get(request.stream_id)
            task = stream.task if stream is not None else None
            if task is None:
                conn.close()  # refused: its Error frame is the whole response
            else:
                task.add_done_callback(transport.stream_done)
            complete = await transport.pump(send)
        finally:
            try:
                if not complete and task is not None and not task.done():
                    # Cut short (the caller went away, a bad frame): as on a tcp Cancel, the
                    # handler is stopped and its task cancelled after the grace; the connection
                    # is gone once it has ended, so that a handler that waits to send does not
                    # see the loss as an error of its own.
                    for stream in list(conn.streams.values()):
                        conn.stop(stream)
                    wait = self.settings.cancel_grace + CANCEL_WAIT_S
                    await asyncio.wait({task}, timeout=wait)
            finally:
                if not conn.closed:
                    conn.connection_lost(None)
        return None

    async def _read_request(
        self, scope: Scope, receive: Receive, send: Send
    ) -> tuple[Request, list[Frame], FrameDecoder] | None:
        """The body's first frame, a Request (and any frames that came with it); None once the
        request is refused (413, 400) or the caller is gone. Never buffers over one frame."""
        limit = self.settings.max_frame_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit + HEADER.size:
                await _reply(send, 413, too_big(int(value) - HEADER.size, limit), close=True)
                return None
        decoder = FrameDecoder(limit)
        frames: list[Frame] = []
        more = True
        while not frames and more:
            try:  # a caller that sends headers and then nothing holds no task for long
                async with asyncio.timeout(self.settings.connect_timeout):
                    message = await receive()
            except TimeoutError:
                await _reply(send, 408, "no Request frame came in time", close=True)
                return None
            if message["type"] != "http.request":
                return None
            body: bytes = message.get("body", b"")
            more = bool(message.get("more_body", False))
            if len(body) >= HEADER.size and not decoder.buffered:
                (size,) = HEADER.unpack_from(body)
                if size > limit:
                    await _reply(send, 413, too_big(size, limit), close=more)
                    return None
            try:
                frames = decoder.feed(body)
            except FrameError as exc:
                await _reply(send, 400, f"{exc}", close=more)
                return None
        if not frames or not isinstance(frames[0], Request):
            got = (
                type(frames[0]).__name__
                if frames
                else ("a truncated frame" if decoder.buffered else "nothing")
            )
            await _reply(
                send, 400, f"the body must start with a Request frame, not {got}", close=more
            )
            return None
        return frames[0], frames[1:], decoder
