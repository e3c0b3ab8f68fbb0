"""Follows the KV events of every live worker of one component on the NATS event plane: one
subscription to the component's `kv_events` subjects, and per worker a `kv_dump` (over the
request plane) to start from.

Invariants: for each worker the index holds its dump plus every event after the dump, applied in
event-id order. A worker is synced by being subscribed first (the subscription is flushed to the
server) and fetching its dump second, so every event the dump lacks arrives afterwards; events
that come while the dump is on its way wait, and those the dump holds (`event_id <=
last_event_id`) are dropped. A gap in the ids, a message dropped by a full queue, or a NATS
reconnect (what was published during the outage is lost) re-syncs from a new dump. A worker
that leaves discovery (the `kv_dump` endpoint's instances) has its blocks and load removed at
once; messages of instances that are not live are ignored.
- A worker whose dump names another model is in `others`: its messages are ignored as if it
  were not live, and it is not re-synced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import msgspec

from kvbaton.protocols.kv import KvDump, KvEvent, KvEventBatch
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.router.indexer import KvIndexer
from kvbaton.runtime import Client, DistributedRuntime
from kvbaton.runtime.event_plane import EventPlane, EventSubscription, event_pattern, instance_of

log = logging.getLogger(__name__)

SYNC_TIMEOUT_S = 10.0  # for the flush and the dump
RESYNC_DELAY_S = 0.5  # between attempts at a worker that failed
RECHECK_S = 1.0  # the live workers are looked at again at least this often
MAX_WAITING = 100_000  # events held while a dump is on its way; more starts the sync over


class _Worker:
    __slots__ = ("expected", "sync", "waiting")

    def __init__(self) -> None:
        self.expected: int | None = None  # the next event id once synced; None while syncing
        self.waiting: list[KvEvent] = []  # events that came while syncing
        self.sync: asyncio.Task[None] | None = None


class NatsKvEvents:
    def __init__(
        self,
        runtime: DistributedRuntime,
        plane: EventPlane,
        component: str,
        indexer: KvIndexer,
        loads: dict[int, WorkerLoad],
        on_dump: Callable[[], None],
        model: str,
        others: set[int],
    ) -> None:
        """`component`: "namespace.component" of the workers; `on_dump` is called for every
        dump applied; `model`: the served name of their model ("": every worker's); `others`:
        where the workers of other models go (see the module's docstring)."""
        self.runtime = runtime
        self.plane = plane
        self.component = component
        self.indexer = indexer
        self.loads = loads
        self._on_dump = on_dump
        self.model = model
        self.others = others
        self._workers: dict[int, _Worker] = {}
        self._decode = msgspec.msgpack.Decoder(KvEventBatch).decode
        self._dumps: Client | None = None
        self._sub: EventSubscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stop_listening: Callable[[], None] | None = None
        self._closed = False

    async def start(self) -> None:
        """Subscribe (ConnectError if NATS cannot be reached) and start following workers."""
        namespace, component = self.component.split(".")
        self._sub = await self.plane.subscribe(event_pattern(namespace, component, "kv_events"))
        self._stop_listening = self.plane.on_connection(self._connection_changed)
        self._dumps = await self.runtime.endpoint(f"{self.component}.kv_dump").client(
            response_type=KvDump
        )
        sub, dumps = self._sub, self._dumps
        self._tasks = [
            asyncio.create_task(self._keep_running(lambda: self._read(sub))),
            asyncio.create_task(self._keep_running(lambda: self._follow_workers(dumps))),
        ]

    async def _keep_running(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run `loop` until closed; a failure is logged, every worker is re-synced (what was
        applied may be partial) and the loop goes on: the index never silently stops."""
        while not self._closed:
            try:
                await loop()
                return
            except Exception:
                log.exception("following the kv events of %s failed; re-syncing", self.component)
                self._resync_all("a failure while following")
                await asyncio.sleep(RESYNC_DELAY_S)

    async def close(self) -> None:
        self._closed = True
        if self._stop_listening is not None:
            self._stop_listening()
        syncs = [w.sync for w in self._workers.values() if w.sync is not None]
        tasks = [*self._tasks, *syncs]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sub is not None:
            await self._sub.close()
        if self._dumps is not None:
            await self._dumps.close()

    # -- workers -----------------------------------------------------------------------------
    async def _follow_workers(self, dumps: Client) -> None:
        while True:
            live = set(dumps.instance_ids())
            for worker_id in live - self._workers.keys():
                self._workers[worker_id] = worker = _Worker()
                self._resync(worker_id, worker, "new worker")
            for worker_id in self._workers.keys() - live:
                worker = self._workers.pop(worker_id)
                if worker.sync is not None:
                    worker.sync.cancel()
                self.others.discard(worker_id)
                self.indexer.remove_worker(worker_id)
                self.loads.pop(worker_id, None)
                log.info("worker %x left: its blocks are out of the index", worker_id)
            with contextlib.suppress(TimeoutError):  # (not wait_for: see kv_events.py)
                async with asyncio.timeout(RECHECK_S):
                    await dumps.wait_for_change()

    def _connection_changed(self, connected: bool) -> None:
        if connected and not self._closed:
            self._resync_all("NATS reconnected")

    def _resync_all(self, why: str) -> None:
        for worker_id, worker in self._workers.items():
            if worker_id not in self.others:
                self._resync(worker_id, worker, why)

    def _resync(self, worker_id: int, worker: _Worker, why: str) -> None:
        """(Re)start the worker's sync. Events received so far are dropped: the dump, taken
        after they were published, holds them."""
        log.info("kv events of worker %x: %s; syncing from a dump", worker_id, why)
        if worker.sync is not None:
            worker.sync.cancel()
        worker.expected = None
        worker.waiting = []
        worker.sync = asyncio.create_task(self._sync(worker_id, worker))

    async def _sync(self, worker_id: int, worker: _Worker) -> None:
        assert self._dumps is not None
        while True:
            try:
                await self.plane.flush(SYNC_TIMEOUT_S)  # our subscription is at the server
                async with asyncio.timeout(SYNC_TIMEOUT_S):
                    stream = self._dumps.direct(None, worker_id, timeout=SYNC_TIMEOUT_S)
                    async with stream:
                        dump: KvDump = await anext(stream)
                break
            except Exception as exc:  # NATS down, the worker not serving yet, a timeout
                reason = str(exc) or type(exc).__name__
                log.info("kv dump of worker %x: %s; retrying", worker_id, reason)
                await asyncio.sleep(RESYNC_DELAY_S)
        worker.sync = None
        if dump.of_another_model(self.model):
            log.info("worker %x serves another model: not indexed", worker_id)
            self.others.add(worker_id)
            self.loads.pop(worker_id, None)  # a report that came during the dump
            worker.waiting = []
            return
        self.indexer.load_dump(worker_id, dump)
        self._on_dump()
        log.debug("worker %x: %d blocks from its dump", worker_id, len(dump.block_hashes))
        worker.expected = dump.last_event_id + 1
        waiting, worker.waiting = worker.waiting, []
        self._apply(worker_id, worker, waiting)

    # -- messages ----------------------------------------------------------------------------
    async def _read(self, sub: EventSubscription) -> None:
        dropped = 0
        async for subject, data in sub:
            if sub.dropped != dropped:  # any worker's events may be among those lost
                dropped = sub.dropped
                self._resync_all("messages dropped (a full queue)")
            worker_id = instance_of(subject)
            worker = self._workers.get(worker_id) if worker_id is not None else None
            if worker is None or worker_id is None or worker_id in self.others:
                continue  # not live (yet, or any more: its dump covers what it sent), or not ours
            try:
                batch = self._decode(data)
            except msgspec.DecodeError as exc:
                log.warning("unreadable kv events from worker %x: %s", worker_id, exc)
                continue
            if worker.expected is None:
                worker.waiting += batch.events
                if len(worker.waiting) > MAX_WAITING:
                    self._resync(worker_id, worker, "too many events during its dump")
            else:
                self._apply(worker_id, worker, batch.events)
                last = batch.last_event_id
                if worker.expected is not None and last is not None and last >= worker.expected:
                    self._resync(worker_id, worker, f"event {last} was sent, not received")
            if batch.load is not None:
                self.loads[worker_id] = batch.load

    def _apply(self, worker_id: int, worker: _Worker, events: list[KvEvent]) -> None:
        """Apply a synced worker's events in order; a gap re-syncs it."""
        assert worker.expected is not None
        for event in events:
            if event.event_id < worker.expected:
                continue  # in the dump already
            if event.event_id > worker.expected:
                gap = f"event {event.event_id} after {worker.expected - 1}"
                self._resync(worker_id, worker, gap)
                return
            self.indexer.apply(worker_id, event)
            worker.expected += 1
