"""A worker's event stream, broker-free: routers subscribe to the worker's `kv_events` endpoint
over the request plane and receive its KV events and load; `kv_dump` gives them the whole cache
to start from.

Invariants: a subscriber receives every event emitted after its subscription began, in event-id
order, batched; the first message of a subscription is sent as soon as it is registered (so a
subscriber that reads it, then asks for a dump, misses nothing between the two); a subscriber
that falls `MAX_BACKLOG` events behind has its stream ended with an error, and re-syncs from a
dump; every subscription ends when the runtime shuts down."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvbaton.protocols.kv import KvEvent, KvEventBatch
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import Context

MAX_BACKLOG = 100_000  # events queued for one subscriber before it is cut off
LOAD_INTERVAL_S = 0.05  # how often load is looked at; it is sent when it changed

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
