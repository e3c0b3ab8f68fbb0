"""The HTTP request plane's client: a lean HTTP/1.1 client on asyncio and httptools (the plane
is described in http_server.py).

Per peer, a pool of keep-alive connections, one per concurrent stream, idle ones reused. (httpx
was measured first: its pool's bookkeeping grows with requests x connections, 41 s for 500
concurrent streams; encode/httpcore#1035.) One `ClientConnection` per POST; `open_stream`
returns once the response headers are in, so a peer that cannot be reached raises ConnectError
and nothing ran. The response body is parsed in the socket's read callback straight into the
connection; its end is the connection's loss (without `End`/`Error` first: StreamBrokenError).
`Cancel` closes the HTTP connection, which the server sees as a disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast
from urllib.parse import urlparse

import httptools
import msgspec

from kvbaton.protocols.frames import Cancel, Frame
from kvbaton.runtime.errors import (
    ConnectError,
    DeadlineExceededError,
    FrameError,
    StreamBrokenError,
)
from kvbaton.runtime.request_plane.framing import payload_decoder
from kvbaton.runtime.request_plane.http_wire import CONTENT_TYPE, PATH
from kvbaton.runtime.request_plane.stream import DEADLINE_SLACK_S, ClientConnection, Stream
from kvbaton.runtime.settings import RuntimeSettings

log = logging.getLogger(__name__)

CLIENT_KEEPALIVE_S = 30.0  # an idle connection older than this is not reused
MAX_IDLE_CONNECTIONS = 1024  # idle connections the client keeps per peer
REFUSAL_BYTES = 4096  # of a refusal's text, kept for the error

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]


class _NoAnswer(Exception):
    """The HTTP connection closed before the response's headers."""

    def __init__(self, got_bytes: bool, exc: BaseException | None) -> None:
        super().__init__(f"connection closed before an answer: {exc or 'closed by the peer'}")
        self.got_bytes = got_bytes


class _HttpConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a peer, carrying one exchange (POST) at a time.

    The response is parsed by httptools; its body goes straight into the exchange's
    `ClientConnection` in the read callback (no task, no copy). A request body is left open
    when its response ends; the next request on this connection closes it in the same write."""

    transport: asyncio.Transport

    def __init__(self, peer: _Peer) -> None:
        self.peer = peer
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: _Exchange | None = None
        self.answer: asyncio.Future[tuple[int, bytes]] | None = None  # (status, refusal text)
        self.status = 0
        self.refusal = bytearray()
        self.got_bytes = False
        self.body_open = False  # the last request's body still wants its final chunk
        self.idle_since = 0.0

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # asyncio and uvloop set it already; make sure
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer.open.add(self)

    def data_received(self, data: bytes) -> None:
        if self.answer is None and self.exchange is None:
            log.error("closing connection to %s: data outside an exchange", self.peer.address)
            self.transport.abort()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            log.error("closing connection to %s: bad HTTP response: %s", self.peer.address, exc)
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.peer.discard(self)
        answer, self.answer = self.answer, None
        if answer is not None and not answer.done():
            answer.set_exception(_NoAnswer(self.got_bytes, exc))
            answer.exception()  # retrieved: its waiter may be gone
            return  # `open_stream` decides: again on another connection, or fail
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.http = None
            if not exchange.conn.closed:
                exchange.conn.connection_lost(exc)  # a body cut short: a broken stream

    # -- httptools callbacks -----------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status == 200 and self.answer is not None and not self.answer.done():
            self.answer.set_result((200, b""))

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            if len(self.refusal) < REFUSAL_BYTES:
                self.refusal += body
        elif self.exchange is not None:
            self.exchange.conn.data_received(body)

    def on_message_complete(self) -> None:
        answer, self.answer = self.answer, None
        if answer is not None and not answer.done():
            answer.set_result((self.status, bytes(self.refusal)))
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.http = None
            if not exchange.conn.closed:
                exchange.conn.connection_lost(None)  # the body's end (without End: broken)
        if self.parser.should_keep_alive() and not self.transport.is_closing():
            self.peer.release(self)
        else:
            self.transport.close()

    # -- exchanges ---------------------------------------------------------------------------
    def start(self, exchange: _Exchange, first: bytes | bytearray) -> asyncio.Future[Any]:
        """Send the request with `first` as the body's first chunk; the future's result is the
        status once the headers are in (for a refusal, with its text, at its end)."""
        self.exchange = exchange
        exchange.http = self
        self.status = 0
        self.refusal.clear()
        self.got_bytes = False
        self.answer = asyncio.get_running_loop().create_future()
        end = b"0\r\n\r\n" if self.body_open else b""
        self.body_open = True
        self.transport.write(
            b"".join((end, self.peer.head, b"%x\r\n" % len(first), first, b"\r\n"))
        )
        return self.answer

    def write_chunk(self, data: bytes | bytearray) -> None:
        self.transport.write(b"".join((b"%x\r\n" % len(data), data, b"\r\n")))


class _Peer:
    """The HTTP connections to one address: every open one, and a stack of idle ones."""

    def __init__(self, client: HttpRequestClient, address: str, host: str, port: int) -> None:
        self.client = client
        self.address = address
        self.host = host
        self.port = port
        self.open: set[_HttpConnection] = set()
        self.idle: list[_HttpConnection] = []  # most recently used last
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.head = (
            f"POST {PATH} HTTP/1.1\r\nhost: {authority}\r\n"
            f"content-type: {CONTENT_TYPE.decode()}\r\ntransfer-encoding: chunked\r\n\r\n"
        ).encode()

    async def checkout(self) -> tuple[_HttpConnection, bool]:
        """An idle connection (True: reused) or a new one; ConnectError if none can be made."""
        now = time.monotonic()
        while self.idle:
            http = self.idle.pop()
            if not http.transport.is_closing() and now - http.idle_since < CLIENT_KEEPALIVE_S:
                return http, True
            http.transport.close()
        loop = asyncio.get_running_loop()
        try:
            _, http = await asyncio.wait_for(
                loop.create_connection(lambda: _HttpConnection(self), self.host, self.port),
                self.client.settings.connect_timeout,
            )
        except (OSError, TimeoutError) as exc:
            raise ConnectError(f"cannot connect to {self.address}: {exc or 'timed out'}") from exc
        return http, False

    def release(self, http: _HttpConnection) -> None:
        if len(self.idle) >= MAX_IDLE_CONNECTIONS:
            http.transport.close()
            return
        http.idle_since = time.monotonic()
        self.idle.append(http)

    def discard(self, http: _HttpConnection) -> None:
        self.open.discard(http)
        if http in self.idle:
            self.idle.remove(http)

    def close(self) -> None:
        for http in list(self.open):
            http.transport.abort()
        self.idle.clear()


class _Exchange(asyncio.Transport):
    """What one POST's `ClientConnection` writes to: its first write (the Request) opens the
    body, later ones (Credit) are more of it; closing it before the response's end closes the
    HTTP connection, which the server sees as a disconnect."""

    def __init__(self, conn: _HttpClientConnection, peer: tuple[str, int]) -> None:
        super().__init__({"peername": peer})
        self.conn = conn
        self.first: bytes | bytearray | None = None
        self.http: _HttpConnection | None = None  # while the response is under way
        self._closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        if isinstance(data, memoryview):
            data = bytes(data)
        if self.first is None:
            self.first = data
        elif self.http is not None:
            self.http.write_chunk(data)
        # else: the response has ended; a late Credit has no one to go to

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self.http is not None:
            self.http.transport.abort()  # its connection_lost ends the exchange

    def abort(self) -> None:
        self.close()

    def is_closing(self) -> bool:
        return self._closing


class _HttpClientConnection(ClientConnection):
    """The client side of one POST: one stream. A `Cancel` closes the HTTP connection rather
    than travel (the server then stops the handler at once, as on a tcp cancel)."""

    def send(self, frame: Frame) -> None:
        if isinstance(frame, Cancel):
            self.close()
        else:
            super().send(frame)

    def request_body(self) -> bytes | bytearray:
        """Write the queued Request now (not on the next loop iteration); the body's start."""
        self._flush()
        transport = self._transport
        assert isinstance(transport, _Exchange) and transport.first is not None
        return transport.first


class HttpRequestClient:
    """One POST per request, over a pool of keep-alive HTTP/1.1 connections per peer (as many
    as there are concurrent streams; idle ones are reused)."""

    def __init__(self, settings: RuntimeSettings) -> None:
        self.settings = settings
        self._peers: dict[str, _Peer] = {}
        self._conns: set[ClientConnection] = set()

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is None:
            parsed = urlparse(address)
            if parsed.scheme != "http" or parsed.hostname is None or parsed.port is None:
                raise ConnectError(f"not an http address: {address!r}")
            peer = self._peers[address] = _Peer(self, address, parsed.hostname, parsed.port)
        return peer

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
        """Send a request; returns once the server took it. Raises ConnectError if the peer
        cannot be reached (nothing ran), FrameError if the request is over the frame limit
        (nothing sent)."""
        peer = self._peer(address)
        conn = _HttpClientConnection(self, address)
        exchange = _Exchange(conn, (peer.host, peer.port))
        conn.connection_made(exchange)
        stream = conn.open(endpoint, payload, request_id, deadline, payload_decoder(response_type))
        first = conn.request_body()
        self._conns.add(conn)
        try:
            status, text = await self._exchange(peer, exchange, first, deadline)
        except BaseException:
            exchange.close()
            if not conn.closed:
                conn.connection_lost(None)
            raise
        if status != 200:
            reason = text.decode("utf-8", "replace")
            if status in (400, 413):
                raise FrameError(f"{address} refused the request: {reason}")
            raise ConnectError(f"{address} answered HTTP {status}: {reason}")
        return stream

    async def _exchange(
        self, peer: _Peer, exchange: _Exchange, first: bytes | bytearray, deadline: float | None
    ) -> tuple[int, bytes]:
        while True:
            http, reused = await peer.checkout()
            if exchange.is_closing():  # the client closed meanwhile
                peer.release(http)
                raise ConnectError(f"{peer.address}: the client is closed")
            answer = http.start(exchange, first)
            # The server answers with its headers before the handler starts: no headers within
            # connect_timeout means nothing ran (a peer that accepted and hangs).
            limit = self.settings.connect_timeout
            by_deadline = deadline is not None and deadline - time.time() + DEADLINE_SLACK_S < limit
            if by_deadline:
                assert deadline is not None
                limit = deadline - time.time() + DEADLINE_SLACK_S
            try:
                return cast(tuple[int, bytes], await asyncio.wait_for(answer, max(0.0, limit)))
            except _NoAnswer as exc:
                exchange.http = None
                if reused and not exc.got_bytes and not exchange.is_closing():
                    continue  # an idle connection the server had closed; nothing was read
                if exc.got_bytes:
                    raise StreamBrokenError(f"{peer.address}: {exc}") from None
                raise ConnectError(f"{peer.address}: {exc}") from None
            except TimeoutError:
                if by_deadline:
                    raise DeadlineExceededError("deadline exceeded (no answer)") from None
                raise ConnectError(f"{peer.address}: no answer within {limit:g}s") from None

    def discard(self, conn: ClientConnection) -> None:
        """A POST ended (ConnectionPool)."""
        self._conns.discard(conn)

    def connections(self) -> list[str]:
        """Peers with an open HTTP connection (busy or idle)."""
        return [address for address, peer in self._peers.items() if peer.open]

    def open_streams(self) -> int:
        return sum(len(conn.streams) for conn in self._conns)

    async def close(self) -> None:
        for conn in list(self._conns):
            conn.close()
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
