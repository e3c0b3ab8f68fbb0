"""The event plane over NATS: fire-and-forget messages on subjects per namespace, component,
topic and instance (`kvbaton.events.{namespace}.{component}.{topic}.{instance_id:x}`). It
carries bytes and knows nothing of what they mean.

Invariants: the messages of one publisher on one subject reach each subscriber in the order they
were published, or not at all (NATS core: a message published while a subscriber is cut off is
lost to it; so is one that finds the subscriber's bounded queue full, which `dropped` counts);
after `flush()` the server has seen every subscription made before it, so a message published
from then on reaches it; `on_connection` tells when the connection drops and comes back (what
was in flight meanwhile may be lost); a NATS server that cannot be reached at the first use is a
ConnectError. Consumers that need every message number them and detect the gaps themselves."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbaton.runtime.names import check_name
from kvbaton.runtime.nats_connections import NatsConnections

if TYPE_CHECKING:  # (nats-py is imported by the connection, when one is made)
    from nats.aio.client import Client as NatsClient
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from kvbaton.runtime.distributed import DistributedRuntime

log = logging.getLogger(__name__)

SUBJECT_ROOT = "kvbaton.events"
MAX_PENDING = 10_000  # messages queued for one subscription before new ones are dropped
FLUSH_TIMEOUT_S = 10.0


def event_subject(namespace: str, component: str, topic: str, instance_id: int) -> str:
    """The subject one instance publishes `topic` on."""
    return f"{event_pattern(namespace, component, topic)[:-1]}{instance_id:x}"


def event_pattern(namespace: str, component: str, topic: str) -> str:
    """The subjects of `topic` of every instance of a component."""
    for kind, name in (("namespace", namespace), ("component", component), ("topic", topic)):
        check_name(kind, name)
    return f"{SUBJECT_ROOT}.{namespace}.{component}.{topic}.*"


def instance_of(subject: str) -> int | None:
    """The instance id an event subject ends with; None if it ends otherwise."""
    try:
        return int(subject.rsplit(".", 1)[-1], 16)
    except ValueError:
        return None


class EventSubscription:
    """The messages of one subscription, as (subject, payload), until `close()`."""

    def __init__(self, max_pending: int) -> None:
        self.dropped = 0  # messages lost because the queue was full
        self._queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue(max_pending)
        self._sub: Subscription | None = None
        self._closed = False

    async def _deliver(self, msg: Msg) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait((msg.subject, msg.data))
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, ...: not a flood of lines
                log.warning("event subscription %s: %d messages dropped", msg.subject, self.dropped)

    def __aiter__(self) -> EventSubscription:
        return self

    async def __anext__(self) -> tuple[str, bytes]:
        if self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        return item

    async def close(self) -> None:
        """Unsubscribe; iteration ends (what is still queued is discarded). Idempotent."""
        if self._closed:
            return
        self._closed = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(None)
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # a connection closed already
                await sub.unsubscribe()


class EventPlane:
    """Publishing and subscribing on one NATS server, through the process's shared connection."""

    def __init__(self, nats: NatsConnections, url: str) -> None:
        self.nats = nats
        self.url = url
        self._conn: NatsClient | None = None  # once made: it reconnects by itself until closed

    @classmethod
    def of(cls, runtime: DistributedRuntime) -> EventPlane | None:
        """The event plane a runtime's settings name; None for the broker-free `direct`."""
        url = runtime.settings.event_plane_url
        return None if url is None else cls(runtime.nats, url)

    async def connection(self) -> NatsClient:
        """The NATS connection (made on first use; ConnectError if the server is not there).
        Kept: once the runtime closed it, using it fails rather than connecting anew."""
        if self._conn is None:
            self._conn = await self.nats.get(self.url)
        return self._conn

    async def publish(self, subject: str, data: bytes) -> None:
        """Queue `data` for `subject`; while reconnecting it waits in the client's bounded
        buffer (an error once that is full). Messages larger than `max_payload` are refused."""
        conn = await self.connection()
        await conn.publish(subject, data)

    async def max_payload(self) -> int:
        """The largest message the server takes."""
        return (await self.connection()).max_payload

    async def subscribe(self, subject: str, *, max_pending: int = MAX_PENDING) -> EventSubscription:
        """Subscribe to `subject` (wildcards allowed) and flush, so that the server knows of the
        subscription when this returns."""
        conn = await self.connection()
        subscription = EventSubscription(max_pending)
        subscription._sub = await conn.subscribe(subject, cb=subscription._deliver)
        try:
            await self.flush()
        except BaseException:
            await subscription.close()
            raise
        return subscription

    async def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Return once the server has processed everything sent on the connection so far (its
        subscriptions included); raises on timeout (as while the connection is down)."""
        conn = await self.connection()
        await conn.flush(timeout)  # type: ignore[arg-type]  # (typed int, used as a float)

    def on_connection(self, listener: Callable[[bool], None]) -> Callable[[], None]:
        """Call `listener(connected)` when the connection to this server drops (False) and when
        it is back (True); returns a function that stops the calls."""

        def relay(url: str, connected: bool) -> None:
            if url == self.url:
                listener(connected)

        return self.nats.add_listener(relay)
