"""The NATS request plane: `NatsRequestServer` and `NatsRequestClient`, each with a carrier per
NATS connection that routes messages to their virtual connections (`NatsTransport`, in
nats_transport.py, which describes the protocol) and publishes what those queue, from one
sender task.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from typing import Any, cast

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError

from kvbaton.runtime.errors import ConnectError, StreamBrokenError
from kvbaton.runtime.nats_connections import NatsConnections
from kvbaton.runtime.request_plane.framing import HEADER as FRAME_HEADER
from kvbaton.runtime.request_plane.framing import payload_decoder
from kvbaton.runtime.request_plane.nats_transport import (
    CLIENT_IDLE_S,
    CLOSE,
    CLOSE_WAIT_S,
    DATA,
    DATA_ACK,
    HELLO,
    HELLO_MSG,
    HELLO_RETRIES,
    HELLO_RETRY_S,
    MESSAGE_HEADER,
    NO_RESPONDERS,
    RESET,
    RESET_MSG,
    SERVER_IDLE_S,
    SUBJECT_PREFIX,
    NatsTransport,
    parse_address,
)
from kvbaton.runtime.request_plane.server import FrameServer, ServerConnection
from kvbaton.runtime.request_plane.stream import (
    ClientConnection,
    ConnectionsByAddress,
    Dials,
    Stream,
)
from kvbaton.runtime.settings import RuntimeSettings

log = logging.getLogger(__name__)


class Carrier:
    """What the virtual connections over one NATS connection share: the sender task, the
    liveness timer, the received messages' dispatch. Subclassed by each side."""

    idle_s = CLIENT_IDLE_S

    def __init__(self, nc: NatsClient, settings: RuntimeSettings, url: str) -> None:
        self.nc = nc
        self.url = url
        self.loop = asyncio.get_running_loop()
        self.max_message = nc.max_payload
        cap = self.max_message - MESSAGE_HEADER.size - FRAME_HEADER.size
        if settings.max_frame_bytes > cap:  # every frame must fit one message
            settings = settings.model_copy(update={"max_frame_bytes": cap})
        self.settings = settings
        self.links: dict[str, NatsTransport] = {}
        self._sub: Subscription | None = None
        self._dirty: dict[NatsTransport, None] = {}
        self._control: list[tuple[str, bytes, str]] = []
        self._wakeup: asyncio.Future[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self._sender = asyncio.create_task(self._send_loop(), name=f"nats-rp-sender {url}")
        self._tick_s = settings.peer_timeout / 8
        self._ticker = self.loop.call_later(self._tick_s, self._tick)

    def reconnects(self) -> int:
        return self.nc.stats["reconnects"]

    async def subscribe(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        """Subscribe; on any failure (or a cancel) stop again, leaving nothing running."""
        try:
            await self.subscribe()
        except BaseException as exc:
            await self.aclose()
            if not isinstance(exc, Exception):
                raise
            raise ConnectError(f"cannot subscribe at NATS {self.url}: {exc!r}") from exc

    # -- sending -----------------------------------------------------------------------------
    def mark(self, link: NatsTransport) -> None:
        if link not in self._dirty:
            self._dirty[link] = None
            self._wake()

    def discard_dirty(self, link: NatsTransport) -> None:
        self._dirty.pop(link, None)

    def control(self, subject: str, message: bytes, reply: str = "") -> None:
        """Publish an unnumbered message (best effort)."""
        if subject and not self._closed:
            self._control.append((subject, message, reply))
            self._wake()

    def _wake(self) -> None:
        self._idle.clear()
        waiter = self._wakeup
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _send_loop(self) -> None:
        while True:
            if not self._dirty and not self._control:
                self._idle.set()
                self._wakeup = self.loop.create_future()
                await self._wakeup
                self._wakeup = None
            try:
                control, self._control = self._control, []
                for subject, message, reply in control:
                    try:
                        await self.nc.publish(subject, message, reply=reply)
                    except Exception as exc:
                        log.debug("nats request plane: could not publish to %s: %s", subject, exc)
                dirty, self._dirty = self._dirty, {}
                for link in dirty:
                    try:
                        await link.send_pending()
                    except Exception:  # a bug; keep sending for the other connections
                        log.exception("nats request plane: sending for %s failed", link.key)
            except Exception:  # a bug; keep sending
                log.exception("nats request plane: sender failed")

    # -- receiving ---------------------------------------------------------------------------
    async def _on_message(self, msg: Msg) -> None:
        try:
            self.dispatch(msg)
        except Exception:
            log.exception("nats request plane: message on %s", msg.subject)

    def dispatch(self, msg: Msg) -> None:
        raise NotImplementedError

    # -- liveness ----------------------------------------------------------------------------
    def _tick(self) -> None:
        self._ticker = self.loop.call_later(self._tick_s, self._tick)
        now = self.loop.time()
        connected = self.nc.is_connected
        epoch = self.reconnects()
        timeout = self.settings.peer_timeout
        for link in list(self.links.values()):
            if link.done or link.closing:
                continue
            if link.waiting():
                link.stop_waiting(now - timeout / 2)
            if link.protocol.streams:
                if not connected or link.epoch != epoch:
                    link.lose(StreamBrokenError(f"the connection to NATS at {self.url} was lost"))
                    continue
                silence = now - max(link.last_rx, link.watch_from)
                if silence > timeout:
                    link.lose(
                        StreamBrokenError(f"no sign of life from {link.peer} in {timeout:g}s")
                    )
                elif silence > timeout / 2 and now - link.last_ping >= timeout / 4:
                    link.ping()  # whatever the peer's own heartbeat interval, it answers now
                elif now - link.last_tx >= timeout / 4:
                    link.heartbeat()
            else:
                link.watch_from = now  # a stream opening now gives the peer a full timeout
                if connected:
                    link.epoch = epoch
                if now - max(link.last_rx, link.last_tx) > self.idle_s:
                    self.forget(link)

    def forget(self, link: NatsTransport) -> None:
        link.protocol.close()

    # -- closing -----------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Publish what is queued (bounded), then stop; connections left are dropped."""
        if self._closed:
            return
        for link in list(self.links.values()):
            link.protocol.close()  # those not closed yet (made while draining) end with CLOSE too
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), CLOSE_WAIT_S)
        self._closed = True
        self._ticker.cancel()
        self._sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._sender
        for link in list(self.links.values()):
            link.lose(None, tell_peer=False)
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_WAIT_S):
                    await sub.unsubscribe()


class ServerCarrier(Carrier):
    idle_s = SERVER_IDLE_S

    def __init__(self, server: FrameServer, nc: NatsClient, url: str, subject: str) -> None:
        super().__init__(nc, server.settings, url)
        self.server = server
        self.subject = subject
        self.listening = False
        self._unsubscribing: asyncio.Task[None] | None = None

    async def subscribe(self) -> None:
        self._sub = await self.nc.subscribe(self.subject, cb=self._on_message)
        # Once the server has the subscription, a hello finds it (no false "no responders").
        await self.nc.flush(timeout=math.ceil(self.settings.connect_timeout))
        self.listening = True

    def close(self) -> None:
        """Stop at once, as a crashed process would: nothing more is received or answered."""
        self.listening = False
        sub, self._sub = self._sub, None
        if sub is not None:
            self._unsubscribing = asyncio.create_task(self._unsubscribe(sub))

    @staticmethod
    async def _unsubscribe(sub: Subscription) -> None:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()

    def dispatch(self, msg: Msg) -> None:
        data, reply = msg.data, msg.reply
        if not self.listening or self._closed or not reply or len(data) < MESSAGE_HEADER.size:
            return
        kind = data[0]
        if kind == HELLO:
            self.control(reply, HELLO_MSG)
            return
        peer = reply.rpartition(".")[0]  # <inbox>.<n>.<seq>: the client's connection, <inbox>.<n>
        link = self.links.get(peer)
        if link is None:
            if kind in (DATA, DATA_ACK) and MESSAGE_HEADER.unpack_from(data)[1] == 0:
                link = self._accept(peer)
            else:
                if kind not in (CLOSE, RESET):  # its start was lost, or it was forgotten
                    self.control(peer, RESET_MSG)
                return
        link.message_received(data)

    def _accept(self, peer: str) -> NatsTransport:
        conn = ServerConnection(self.server)
        link = NatsTransport(self, conn, peer, to=peer, reply="", peer=peer)
        self.links[peer] = link
        conn.connection_made(link)
        return link


class NatsRequestServer(FrameServer):
    """Serves on a subject of its own at the settings' NATS server."""

    transport = "nats"

    def __init__(self, settings: RuntimeSettings, nats: NatsConnections) -> None:
        super().__init__(settings)
        self._nats = nats
        self._server: ServerCarrier | None = None

    async def start(self) -> str:
        url = self.settings.nats_url
        nc = await self._nats.get(url)
        subject = f"{SUBJECT_PREFIX}{uuid.uuid4().hex}"
        carrier = ServerCarrier(self, nc, url, subject)
        self.settings = carrier.settings  # frames capped to one message
        self._server = carrier
        await carrier.start()
        self.address = f"{url}/{subject}"
        return self.address

    async def stop_listening(self) -> None:
        """Keep the subscription: requests arriving while draining are refused (SHUTTING_DOWN)."""

    async def closed(self) -> None:
        if self._server is not None:
            await self._server.aclose()


class ClientCarrier(Carrier):
    """A client's virtual connections through one NATS server, under one inbox."""

    def __init__(self, client: NatsRequestClient, nc: NatsClient, url: str) -> None:
        super().__init__(nc, client.settings, url)
        self.client = client
        self.inbox = nc.new_inbox()
        self._ids = itertools.count()

    async def subscribe(self) -> None:
        # <inbox>.<n>: what servers send; <inbox>.<n>.<seq>: what NATS bounces
        self._sub = await self.nc.subscribe(f"{self.inbox}.>", cb=self._on_message)

    def discard(self, conn: ClientConnection) -> None:  # ConnectionPool
        self.client.discard(conn)

    def connect(self, address: str, subject: str) -> NatsTransport:
        conn = ClientConnection(self, address)
        key = f"{self.inbox}.{next(self._ids)}"
        link = NatsTransport(self, conn, key, to=subject, reply=key, peer=address)
        self.links[key] = link
        conn.connection_made(link)
        return link

    def dispatch(self, msg: Msg) -> None:
        link = self.links.get(msg.subject)
        if link is not None:
            link.message_received(msg.data)
        elif msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            key, _, seq = msg.subject.rpartition(".")
            link = self.links.get(key)
            if link is not None and seq.isdigit():
                link.bounced(int(seq))

    def forget(self, link: NatsTransport) -> None:
        conn = link.protocol
        if isinstance(conn, ClientConnection):
            self.client.discard(conn)  # no new stream may start on it while it closes
        conn.close()


_Dialed = tuple[ClientConnection, NatsTransport]


class NatsRequestClient(ConnectionsByAddress):
    """One virtual connection per server address, through the NATS server the address names."""

    def __init__(self, settings: RuntimeSettings, nats: NatsConnections) -> None:
        super().__init__(settings)
        self._nats = nats
        self._carriers: dict[str, ClientCarrier] = {}
        self._carrier_lock = asyncio.Lock()
        self._links: dict[str, NatsTransport] = {}  # the transport of each of _conns
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
        conn, link = self._conns.get(address), self._links.get(address)
        if conn is not None and link is not None and not conn.streams and self._stale(link):
            # Silent for a while: its server may be long gone, or its host. A new hello says
            # so now (ConnectError), where a request would only break after the peer timeout.
            self.discard(conn)
            conn.close()
            conn = None
        if conn is None or link is None or conn.closed or link.done:
            conn, link = await self._connect(address)
        if not link.carrier.nc.is_connected:  # it would only be queued, and break
            raise ConnectError(f"cannot reach {address}: the NATS connection is down")
        delivery = link.expect_delivery()
        try:
            stream = conn.open(
                endpoint, payload, request_id, deadline, payload_decoder(response_type)
            )
        except BaseException:
            link.forget_delivery(delivery)
            raise
        delivery.stream_id = stream.stream_id
        # Resolved by the server's acknowledgement, or by the carrier after peer_timeout / 2 (a
        # busy server?): then the stream's liveness decides. ConnectError if NATS bounced it.
        try:
            if deadline is not None and deadline - time.time() < self.settings.peer_timeout / 2:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, deadline - time.time())):
                        await delivery.future
            else:
                await delivery.future
        except asyncio.CancelledError:
            stream.cancel()
            raise
        return stream

    async def _carrier(self, url: str) -> ClientCarrier:
        async with self._carrier_lock:
            carrier = self._carriers.get(url)
            if carrier is None:
                nc = await self._nats.get(url)  # ConnectError if it cannot be reached
                carrier = ClientCarrier(self, nc, url)
                await carrier.start()
                self._carriers[url] = carrier
            return carrier

    async def _dial(self, address: str) -> _Dialed:
        url, subject = parse_address(address)
        carrier = await self._carrier(url)
        for attempt in range(HELLO_RETRIES + 1):
            try:
                reply = await carrier.nc.request(
                    subject, HELLO_MSG, timeout=self.settings.connect_timeout
                )
                break
            except NoRespondersError as exc:
                if attempt == HELLO_RETRIES:
                    raise ConnectError(f"cannot connect to {address}: nobody serves it") from exc
                await asyncio.sleep(HELLO_RETRY_S)
            except Exception as exc:  # nats-py's TimeoutError; a closed or reconnecting client
                reason = str(exc) or type(exc).__name__
                raise ConnectError(f"cannot connect to {address}: {reason}") from exc
        if reply.data[:1] != HELLO_MSG[:1]:
            raise ConnectError(f"cannot connect to {address}: not a kvbaton request plane")
        link = carrier.connect(address, subject)
        conn = cast(ClientConnection, link.protocol)
        self._conns[address] = conn
        self._links[address] = link
        return conn, link

    def _stale(self, link: NatsTransport) -> bool:
        return link.carrier.loop.time() - link.last_rx > self.settings.peer_timeout

    def transport(self, address: str) -> NatsTransport | None:
        """The open virtual connection to `address`, if any (for tests and diagnostics)."""
        return self._links.get(address)

    def discard(self, conn: ClientConnection) -> None:
        if self._conns.get(conn.address) is conn:
            self._links.pop(conn.address, None)
        super().discard(conn)

    async def close(self) -> None:
        self._connect.cancel()
        for conn in list(self._conns.values()):
            conn.close()
        self._conns.clear()
        self._links.clear()
        carriers, self._carriers = list(self._carriers.values()), {}
        for carrier in carriers:
            await carrier.aclose()
