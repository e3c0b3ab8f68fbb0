"""The NATS request plane's virtual connections: the frames of the TCP plane, carried in NATS
messages (the carriers, server and client that use them: nats_plane.py).

A server subscribes to a subject of its own, `kvbaton.rp.<hex>`, and advertises
`<nats_url>/<subject>`. A client subscribes to one inbox (`<inbox>.*`) per NATS server and makes
one virtual connection per server address, `<inbox>.<n>`: its messages go to the server's
subject with that reply subject, the server's come back to it. Each end of a virtual connection
is a `NatsTransport` under the same `ClientConnection` / `ServerConnection` as over TCP, so
streams, cancellation, credit and deadlines behave the same.

A message is a 9-byte header (kind, sequence number) and, for DATA, whole frames:
- DATA: frames (none: a heartbeat); PING: "answer with a heartbeat now"; ACK: "I received this
  many bytes of frames"; CLOSE: the sender closed the connection after what it sent. These are
  numbered per direction from 0; NATS core may lose messages (a reconnect, a slow consumer), so
  a receiver that sees a gap drops the connection: its streams break rather than miss responses.
- RESET: "this connection is gone" (not numbered): sent on a gap, an abort, an unknown connection.
- HELLO: the client's request/reply to the server subject before the first use of an address:
  no responder (NATS says so at once) or no reply in `connect_timeout` is a ConnectError.

Delivery: a client's message carries the reply subject `<inbox>.<n>.<seq>`, so when NATS bounces
it ("no responders": the server's subject has no subscriber, e.g. the process was killed) the
client knows which message did not arrive. A message holding a new request asks the server to
acknowledge it at once (DATA_ACK), and `open_stream` returns once it is acknowledged (or after
`peer_timeout / 2`): a request that bounced raises ConnectError, as nothing was sent, and the
caller tries another instance. The acknowledgement usually travels with or ahead of the first
response, so this costs a small message, not latency.

Liveness: NATS gives no connection between the two ends, so while a connection has open streams
each end sends a heartbeat when it sent nothing for `peer_timeout / 4`, pings the other end after
`peer_timeout / 2` of silence (so that ends with different settings agree), and drops the
connection after `peer_timeout` without a message from the other end. Open streams are also
dropped when the process's own NATS connection was lost or reconnected (messages may have been
lost meanwhile), and the other end is told so (RESET) once NATS is back.
A client also learns at once that a server is gone when NATS bounces one of its messages, and
does not reuse a connection that has been silent for `peer_timeout`: it says hello again first.
Idle connections are closed after a while (clients first, servers later).

Sending: a transport's `write` appends to its buffer; one sender task per NATS connection
publishes each dirty buffer, split at frame boundaries into messages of at most the server's
`max_payload` (frames are limited to fit one message). NATS has no backpressure between the two
ends, and nats-server cuts off a consumer that falls 64 MB behind, so a transport pauses its
protocol (as a full socket would) while more than `FLOW_WINDOW` bytes it sent are unacknowledged
or more than `PAUSE_BYTES` wait to be published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from kvbaton.runtime.errors import ConnectError, FrameError, StreamBrokenError
from kvbaton.runtime.request_plane.framing import HEADER as FRAME_HEADER
from kvbaton.runtime.request_plane.server import ServerConnection
from kvbaton.runtime.request_plane.stream import ClientConnection

if TYPE_CHECKING:
    from kvbaton.runtime.request_plane.nats_plane import Carrier

log = logging.getLogger(__name__)

MESSAGE_HEADER = struct.Struct(">BQ")  # kind, sequence number
ACK_BODY = struct.Struct(">Q")  # bytes of frames received so far
DATA, CLOSE, RESET, HELLO, PING, ACK, DATA_ACK = 0, 1, 2, 3, 4, 5, 6
SUBJECT_PREFIX = "kvbaton.rp."
PAUSE_BYTES = 4 * 1024 * 1024  # unsent bytes at which a transport pauses its protocol
FLOW_WINDOW = 8 * 1024 * 1024  # sent bytes not yet acknowledged at which it pauses it too
ACK_EVERY = FLOW_WINDOW // 4  # a receiver acknowledges each time it got this much more
CLIENT_IDLE_S = 60.0  # a client closes a connection without streams nor traffic this long
SERVER_IDLE_S = 120.0  # a server forgets one (later than clients, so they close first)
CLOSE_WAIT_S = 1.0  # how long closing waits for the sender to publish what is queued
# A freshly started (or restarted) nats-server answers the very first request now and then with
# "no responders" although the subscription is in place; a second try a moment later is right.
HELLO_RETRIES = 2
HELLO_RETRY_S = 0.05

NO_RESPONDERS = "503"  # the status of what NATS sends back for a message nobody subscribes to
RESET_MSG = MESSAGE_HEADER.pack(RESET, 0)
HELLO_MSG = MESSAGE_HEADER.pack(HELLO, 0)
_PLACEHOLDER = bytes(MESSAGE_HEADER.size)


def pack_message(kind: int, seq: int, frames: bytes = b"") -> bytes:
    """A message of the plane (tests feed these to a transport)."""
    return MESSAGE_HEADER.pack(kind, seq) + frames


def parse_address(address: str) -> tuple[str, str]:
    """`nats://host:port/kvbaton.rp.<hex>` -> (NATS URL, subject); ConnectError if it is not."""
    url, sep, subject = address.rpartition("/")
    if not sep or not url.startswith("nats://") or not subject.startswith(SUBJECT_PREFIX):
        raise ConnectError(f"not a nats request-plane address: {address!r}")
    return url, subject


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(eq=False, slots=True)
class Delivery:
    """Whether the message holding a new request reached the server: resolved when the server
    acknowledges it (or the connection is lost otherwise), failed with ConnectError when NATS
    bounced it. `target`: the offset of the request's end in the bytes written."""

    future: asyncio.Future[None]
    created: float
    stream_id: int | None = None
    target: int = -1
    seq: int = -1  # the message that holds it, once published


class NatsTransport(asyncio.Transport):
    """One end of a virtual connection: the transport of a Client/ServerConnection."""

    def __init__(
        self,
        carrier: Carrier,
        protocol: ClientConnection | ServerConnection,
        key: str,
        to: str,
        reply: str,
        peer: str,
    ) -> None:
        super().__init__({"peername": peer})
        self.carrier = carrier
        self.protocol = protocol
        self.key = key  # in carrier.links: the subject naming this connection
        self.to = to  # where its messages go
        self.reply = reply  # the reply subject they carry (a client's: its own key)
        self.peer = peer
        self.tx_seq = 0
        self.rx_seq = 0
        self.out = bytearray()  # a header placeholder, then whole frames
        self.closing = False  # close() called: send what is queued, then CLOSE
        self.done = False  # gone: connection_lost is scheduled
        self.paused = False
        self.heartbeat_due = False
        self.ping_due = False
        self.ack_due = False
        self.rx_bytes = self.rx_acked = 0  # frame bytes received; acknowledged to the peer
        self.tx_bytes = self.tx_acked = 0  # frame bytes sent; acknowledged by the peer
        self.written = 0  # frame bytes given to write()
        self._untargeted: list[Delivery] = []  # their request is not written yet
        self._unsent: deque[Delivery] = deque()  # written, not yet published
        self._sent: deque[Delivery] = deque()  # published, not yet acknowledged
        now = carrier.loop.time()
        self.last_rx = self.last_tx = self.watch_from = self.last_ping = now
        self.epoch = carrier.reconnects()

    # -- asyncio.Transport -------------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.done or self.closing or not data:
            return
        if not self.out:
            self.out += _PLACEHOLDER
        self.out += data
        self.written += len(data)
        if self._untargeted:  # the protocol writes all it queued at once: their requests too
            for delivery in self._untargeted:
                delivery.target = self.written
            self._unsent.extend(self._untargeted)
            self._untargeted.clear()
        self.carrier.mark(self)
        if not self.paused and len(self.out) > PAUSE_BYTES:
            self.paused = True
            self.protocol.pause_writing()

    def _flow(self) -> None:
        """Pause the protocol while too much is unsent or unacknowledged; resume at a quarter
        unsent and half the window unacknowledged."""
        unacked = self.tx_bytes - self.tx_acked
        if self.paused:
            if len(self.out) <= PAUSE_BYTES // 4 and unacked <= FLOW_WINDOW // 2:
                self.paused = False
                self.protocol.resume_writing()
        elif len(self.out) > PAUSE_BYTES or unacked > FLOW_WINDOW:
            self.paused = True
            self.protocol.pause_writing()

    def close(self) -> None:
        if not self.done and not self.closing:
            self.closing = True
            self.carrier.mark(self)

    def abort(self) -> None:
        self.lose(None)

    def is_closing(self) -> bool:
        return self.closing or self.done

    def get_write_buffer_size(self) -> int:
        return len(self.out)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol

    # -- delivery of new requests (client side) ----------------------------------------------
    def expect_delivery(self) -> Delivery:
        """Call before queueing a request: the Delivery of the next bytes written."""
        loop = self.carrier.loop
        delivery = Delivery(loop.create_future(), loop.time())
        if self.done or self.closing:
            delivery.future.set_result(None)  # the stream breaks as the connection goes
        else:
            self._untargeted.append(delivery)
        return delivery

    def waiting(self) -> bool:
        return bool(self._sent or self._unsent or self._untargeted)

    def stop_waiting(self, before: float) -> None:
        """Let the callers waiting since before `before` go on without an acknowledgement."""
        for queue in (self._sent, self._unsent):
            while queue and queue[0].created < before:
                _resolve(queue.popleft().future)
        while self._untargeted and self._untargeted[0].created < before:
            _resolve(self._untargeted.pop(0).future)

    def forget_delivery(self, delivery: Delivery) -> None:
        with contextlib.suppress(ValueError):
            self._untargeted.remove(delivery)

    def bounced(self, seq: int) -> None:
        """NATS returned message `seq` (and so every later one): nobody serves the subject."""
        if self.done:
            return
        refused = ConnectError(f"cannot reach {self.peer}: nobody serves it (NATS: no responders)")
        for delivery in self._sent:
            if delivery.seq < seq:
                _resolve(delivery.future)  # it arrived before the server went
            else:
                self._refuse(delivery, refused)
        for delivery in (*self._unsent, *self._untargeted):
            self._refuse(delivery, refused)
        self._sent.clear()
        self._unsent.clear()
        self._untargeted.clear()
        reason = f"nobody serves {self.peer} any more (NATS: no responders)"
        self.lose(StreamBrokenError(reason), tell_peer=False)

    def _refuse(self, delivery: Delivery, exc: ConnectError) -> None:
        """The request never arrived: its caller gets ConnectError, unless it stopped waiting
        (then its stream breaks with the connection)."""
        if not delivery.future.done():
            delivery.future.set_exception(exc)
            delivery.future.exception()  # retrieved: no warning if the waiter is gone
            if delivery.stream_id is not None:
                self.protocol.streams.pop(delivery.stream_id, None)

    # -- receiving ---------------------------------------------------------------------------
    def message_received(self, data: bytes) -> None:
        if self.done or len(data) < MESSAGE_HEADER.size:
            return
        kind, seq = MESSAGE_HEADER.unpack_from(data)
        if kind == RESET:
            self._finish(StreamBrokenError(f"{self.peer} dropped the connection"))
            return
        if seq != self.rx_seq:
            self.lose(
                StreamBrokenError(
                    f"messages from {self.peer} were lost (expected #{self.rx_seq}, got #{seq})"
                )
            )
            return
        self.rx_seq = seq + 1
        self.last_rx = self.carrier.loop.time()
        if kind in (DATA, DATA_ACK):
            if len(data) > MESSAGE_HEADER.size:
                self.rx_bytes += len(data) - MESSAGE_HEADER.size
                if kind == DATA_ACK or self.rx_bytes - self.rx_acked >= ACK_EVERY:
                    self.ack_due = True
                    self.carrier.mark(self)
                self.protocol.data_received(data[MESSAGE_HEADER.size :])
        elif kind == ACK:
            (acked,) = ACK_BODY.unpack_from(data, MESSAGE_HEADER.size)
            self.tx_acked = max(self.tx_acked, acked)
            sent = self._sent
            while sent and sent[0].target <= acked:
                _resolve(sent.popleft().future)
            self._flow()
        elif kind == PING:
            self.heartbeat()
        elif kind == CLOSE:
            self._finish(None)
        else:
            self.lose(StreamBrokenError(f"unknown message kind {kind} from {self.peer}"))

    # -- ending ------------------------------------------------------------------------------
    def lose(self, exc: Exception | None, tell_peer: bool = True) -> None:
        """Drop the connection at once (telling the peer unless it told us)."""
        if self.done:
            return
        if exc is not None:
            log.warning("nats request plane: connection %s dropped: %s", self.peer, exc)
        if tell_peer:
            self.carrier.control(self.to, RESET_MSG, self.reply and f"{self.reply}.r")
        self._finish(exc)

    def _finish(self, exc: Exception | None) -> None:
        if self.done:
            return
        self.done = True
        self.out = bytearray()
        for delivery in (*self._sent, *self._unsent, *self._untargeted):
            _resolve(delivery.future)  # their streams break with the connection
        self._sent.clear()
        self._unsent.clear()
        self._untargeted.clear()
        carrier = self.carrier
        if carrier.links.get(self.key) is self:
            del carrier.links[self.key]
        carrier.discard_dirty(self)
        carrier.loop.call_soon(self.protocol.connection_lost, exc)

    # -- sending (by the carrier's sender task only) -----------------------------------------
    def heartbeat(self) -> None:
        self.heartbeat_due = True
        self.carrier.mark(self)

    def ping(self) -> None:
        self.ping_due = True
        self.last_ping = self.carrier.loop.time()
        self.carrier.mark(self)

    async def send_pending(self) -> None:
        if self.done:
            return
        heartbeat, self.heartbeat_due = self.heartbeat_due, False
        if self.ack_due:
            self.ack_due = heartbeat = False
            self.rx_acked = self.rx_bytes
            ack = bytearray(MESSAGE_HEADER.pack(ACK, self.tx_seq))
            ack += ACK_BODY.pack(self.rx_bytes)
            await self._publish(ack)
        if self.ping_due and not self.done:
            self.ping_due = heartbeat = False
            await self._publish(bytearray(MESSAGE_HEADER.pack(PING, self.tx_seq)))
        if self.out and not self.done:
            buf, self.out = self.out, bytearray()
            try:
                await self._send_frames(buf)
            except FrameError as exc:  # cannot happen with frames capped to the max payload
                self.lose(StreamBrokenError(str(exc)))
                return
            if self.done:
                return
            self._flow()
        elif heartbeat and not self.done:
            await self._publish(bytearray(MESSAGE_HEADER.pack(DATA, self.tx_seq)))
        if self.closing and not self.out and not self.done:
            await self._publish(bytearray(MESSAGE_HEADER.pack(CLOSE, self.tx_seq)))
            self._finish(None)

    async def _send_frames(self, buf: bytearray) -> None:
        limit = self.carrier.max_message
        if len(buf) <= limit:
            await self._publish_frames(buf, len(buf) - MESSAGE_HEADER.size)
            return
        view = memoryview(buf)
        try:
            pos, end = MESSAGE_HEADER.size, len(buf)
            while pos < end and not self.done:
                start = pos
                while pos < end:
                    (size,) = FRAME_HEADER.unpack_from(buf, pos)
                    after = pos + FRAME_HEADER.size + size
                    if after - start + MESSAGE_HEADER.size > limit:
                        if pos == start:
                            raise FrameError(
                                f"frame of {size} bytes does not fit a NATS message "
                                f"(max_payload {limit})"
                            )
                        break
                    pos = after
                message = bytearray(_PLACEHOLDER)
                message += view[start:pos]
                await self._publish_frames(message, pos - start)
        finally:
            view.release()

    async def _publish_frames(self, message: bytearray, size: int) -> None:
        """Publish a message of `size` bytes of frames after its header's room; one that holds
        a new request asks for an acknowledgement at once."""
        end = self.tx_bytes + size
        self.tx_bytes = end
        unsent = self._unsent
        if unsent and unsent[0].target <= end:
            MESSAGE_HEADER.pack_into(message, 0, DATA_ACK, self.tx_seq)
            while unsent and unsent[0].target <= end:
                delivery = unsent.popleft()
                delivery.seq = self.tx_seq
                self._sent.append(delivery)
        else:
            MESSAGE_HEADER.pack_into(message, 0, DATA, self.tx_seq)
        await self._publish(message)

    async def _publish(self, message: bytearray) -> None:
        # A client's reply subject names the message too: NATS bounces it there.
        reply = f"{self.reply}.{self.tx_seq}" if self.reply else ""
        self.tx_seq += 1
        self.last_tx = self.carrier.loop.time()
        try:
            await self.carrier.nc.publish(self.to, cast(bytes, message), reply=reply)
        except Exception as exc:  # closed, or its reconnect buffer is full: messages are lost
            self.lose(StreamBrokenError(f"cannot publish to NATS: {exc or type(exc).__name__}"))
