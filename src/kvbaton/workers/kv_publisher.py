"""A worker's event stream, its KV events and load. Broker-free, routers subscribe to the
worker's `kv_events` endpoint; on a NATS event plane the worker `publish`es the same batches on
its subject instead. Either way `kv_dump` (an endpoint) gives the whole cache to start from.

- A subscriber receives every event emitted after its subscription began, in event-id order,
  batched; the first batch goes as soon as it is registered (read it, then dump: none missed).
- A subscriber `MAX_BACKLOG` events behind has its stream ended with an error (it re-syncs
  from a dump); every subscription ends when the runtime shuts down.
- Published batches leave in event-id order, split to fit the plane's size limit; the load
  goes out when it changed and at least every `LOAD_REFRESH_S` (for routers that come later).
- An event lost on the way (a failed publish, or one too big alone) shows as a gap in the
  ids, which routers heal with a dump.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import msgspec

from kvbaton.protocols.kv import KvEvent, KvEventBatch
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import Component, Context
from kvbaton.runtime.event_plane import EventPlane, event_subject

MAX_BACKLOG = 100_000  # events queued for one subscriber before it is cut off
LOAD_INTERVAL_S = 0.05  # how often load is looked at; it is sent when it changed
LOAD_REFRESH_S = 1.0  # published: the load is sent at least this often, changed or not

log = logging.getLogger(__name__)
_encode = msgspec.msgpack.Encoder().encode

_CLOSED = object()
_BEHIND = object()


class _Subscriber:
    __slots__ = ("events", "load", "ready", "state")

    def __init__(self) -> None:
        self.events: list[KvEvent] = []
        self.load: WorkerLoad | None = None
        self.ready = asyncio.Event()
        self.state: object = None  # _CLOSED or _BEHIND once it must end


class KvEventPublisher:
    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._subscribers: set[_Subscriber] = set()
        self._load: WorkerLoad | None = None
        self._ticker: asyncio.Task[None] | None = None

    def on_event(self, event: KvEvent) -> None:
        """The engine's callback; called on its step thread."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens any more
            self._loop.call_soon_threadsafe(self._fan_out, event)

    def _fan_out(self, event: KvEvent) -> None:
        for sub in self._subscribers:
            if sub.state is not None:
                continue
            sub.events.append(event)
            if len(sub.events) > MAX_BACKLOG:
                sub.state = _BEHIND
            sub.ready.set()

    def start(self, load: Callable[[], WorkerLoad]) -> None:
        """Send `load()` to subscribers whenever it changed, every LOAD_INTERVAL_S."""
        self._ticker = asyncio.create_task(self._tick(load))

    async def _tick(self, load: Callable[[], WorkerLoad]) -> None:
        while True:
            current = load()
            if current != self._load:
                self._load = current
                for sub in self._subscribers:
                    sub.load = current
                    sub.ready.set()
            await asyncio.sleep(LOAD_INTERVAL_S)

    def close(self) -> None:
        """End every subscription (the worker stops)."""
        if self._ticker is not None:
            self._ticker.cancel()
        for sub in self._subscribers:
            sub.state = _CLOSED
            sub.ready.set()

    async def subscribe(self, request: Any, context: Context) -> AsyncIterator[KvEventBatch]:
        """The `kv_events` handler: a first (possibly empty) batch at once, then one batch per
        wake-up, until the caller leaves, falls too far behind, or the worker stops."""
        sub = _Subscriber()
        self._subscribers.add(sub)
        try:
            yield KvEventBatch(load=self._load)
            while True:
                await sub.ready.wait()
                sub.ready.clear()
                if sub.state is _CLOSED:
                    return
                if sub.state is _BEHIND:
                    raise RuntimeError(f"subscriber fell {MAX_BACKLOG} events behind; re-sync")
                events, sub.events = sub.events, []
                load, sub.load = sub.load, None
                yield KvEventBatch(events=events, load=load)
        finally:
            self._subscribers.discard(sub)

    async def sender(
        self, component: Component, instance_id: int
    ) -> Callable[[], Coroutine[Any, Any, None]]:
        """What sends the stream of `component`'s instance: its `kv_events` endpoint (broker-free)
        or `publish` on its subject of the NATS event plane (ConnectError if NATS is not
        there). Call it to run it."""
        runtime = component.namespace.runtime
        plane = EventPlane.of(runtime)
        if plane is None:
            endpoint = component.endpoint("kv_events")
            return functools.partial(endpoint.serve_endpoint, self.subscribe)
        namespace = component.namespace.name
        subject = event_subject(namespace, component.name, "kv_events", instance_id)
        max_bytes = await plane.max_payload()  # connects
        return functools.partial(self.publish, functools.partial(plane.publish, subject), max_bytes)

    async def publish(self, send: Callable[[bytes], Awaitable[None]], max_bytes: int) -> None:
        """Send the event stream through `send` (msgpack KvEventBatch-es of at most `max_bytes`,
        one or more per wake-up, in order) until `close()`."""
        sub = _Subscriber()
        self._subscribers.add(sub)
        sub.ready.set()  # the load at once, if known
        load_sent = -LOAD_REFRESH_S
        last_event_id: int | None = None  # of the events sent so far
        failed = 0  # batches not published since the last one that was
        try:
            while sub.state is not _CLOSED:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(LOAD_REFRESH_S):
                        await sub.ready.wait()
                sub.ready.clear()
                if sub.state is _BEHIND:  # the plane is stuck: drop; routers see the gap
                    log.warning("KV events: %d unsent events dropped", len(sub.events))
                    last_event_id = sub.events[-1].event_id
                    sub.events, sub.state = [], None
                events, sub.events = sub.events, []
                load, sub.load = sub.load, None
                now = time.monotonic()
                if load is None and now - load_sent >= LOAD_REFRESH_S:
                    load = self._load
                if load is not None:
                    load_sent = now
                if events:
                    last_event_id = events[-1].event_id
                if events or load is not None:
                    for data in _encoded(events, load, last_event_id, max_bytes):
                        try:
                            await send(data)
                        except Exception as exc:  # down too long, or too big: routers re-sync
                            if not failed:
                                log.warning("KV events: publishing fails (%s); retrying", exc)
                            failed += 1
                        else:
                            if failed:
                                log.info("KV events: published again (%d batches lost)", failed)
                            failed = 0
        finally:
            self._subscribers.discard(sub)


def _encoded(
    events: list[KvEvent], load: WorkerLoad | None, last_event_id: int | None, max_bytes: int
) -> list[bytes]:
    """The batch, split in halves until each part fits in `max_bytes` (the load and the last
    event id ride on the last part; a single event too big for the plane stays one message,
    and fails)."""
    data = _encode(KvEventBatch(events=events, load=load, last_event_id=last_event_id))
    if len(data) <= max_bytes or len(events) <= 1:
        return [data]
    half = len(events) // 2
    return _encoded(events[:half], None, None, max_bytes) + _encoded(
        events[half:], load, last_event_id, max_bytes
    )
