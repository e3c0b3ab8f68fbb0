"""Follows the KV events of every live worker of one component. Broker-free (the `direct` event
plane): a subscription to each worker's `kv_events` endpoint over the request plane, started
from a `kv_dump`. On a NATS event plane: `kv_events_nats.py`, with the same invariants.

Invariants: for each worker the index holds its dump plus every event after the dump, applied
in event-id order; a gap in the ids (or a broken stream) re-syncs that worker from a new dump; a
worker that leaves discovery has its blocks and its load removed at once.
- A worker whose dump names another model (several models' workers on one component) is in
  `others`: none of its blocks or loads is kept, and it is not followed further.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvbaton.protocols.kv import KvDump, KvEventBatch
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.router.indexer import KvIndexer
from kvbaton.router.kv_events_nats import NatsKvEvents
from kvbaton.runtime import Client, DistributedRuntime
from kvbaton.runtime.event_plane import EventPlane

log = logging.getLogger(__name__)

SYNC_TIMEOUT_S = 10.0  # for a worker's first message and its dump
RESYNC_DELAY_S = 0.5  # between attempts at a worker that failed
RECHECK_S = 1.0  # the live workers are looked at again at least this often


class EventGapError(Exception):
    pass


class KvEventSubscriber:
    def __init__(
        self,
        runtime: DistributedRuntime,
        component: str,
        indexer: KvIndexer,
        loads: dict[int, WorkerLoad],
        model: str = "",
    ) -> None:
        """`component`: "namespace.component" of the workers; `model`: the served name of
        their model ("": every worker's)."""
        self.runtime = runtime
        self.component = component
        self.indexer = indexer
        self.loads = loads
        self.model = model
        self.others: set[int] = set()  # workers of other models, not indexed
        self.dumps = 0  # dumps applied (a new worker, a gap, a broken stream)
        self._events: Client | None = None
        self._dumps: Client | None = None
        self._workers: dict[int, asyncio.Task[None]] = {}
        self._follow: asyncio.Task[None] | None = None
        self._nats: NatsKvEvents | None = None

    def _dumped(self) -> None:
        self.dumps += 1

    async def start(self) -> None:
        """Start following the workers (ConnectError if the NATS event plane is not there)."""
        plane = EventPlane.of(self.runtime)
        if plane is not None:
            self._nats = NatsKvEvents(
                self.runtime,
                plane,
                self.component,
                self.indexer,
                self.loads,
                self._dumped,
                self.model,
                self.others,
            )
            await self._nats.start()
            return
        self._events = await self.runtime.endpoint(f"{self.component}.kv_events").client(
            response_type=KvEventBatch
        )
        self._dumps = await self.runtime.endpoint(f"{self.component}.kv_dump").client(
            response_type=KvDump
        )
        self._follow = asyncio.create_task(self._follow_workers(self._events))

    async def close(self) -> None:
        if self._nats is not None:
            await self._nats.close()
        tasks = [t for t in [self._follow, *self._workers.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in (self._events, self._dumps):
            if client is not None:
                await client.close()

    async def _follow_workers(self, events: Client) -> None:
        while True:
            live = set(events.instance_ids())
            for worker in live - self._workers.keys():
                self._workers[worker] = asyncio.create_task(self._sync(worker))
            for worker in self._workers.keys() - live:
                self._workers.pop(worker).cancel()
                self.others.discard(worker)
                self.indexer.remove_worker(worker)
                self.loads.pop(worker, None)
                log.info("worker %x left: its blocks are out of the index", worker)
            # A quarantine ends without a change event. (asyncio.timeout, not wait_for: under
            # Python 3.11 and uvloop, cancelling a task inside wait_for here could hang it.)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RECHECK_S):
                    await events.wait_for_change()

    async def _sync(self, worker: int) -> None:
        """Follow `worker` while it is the one this task follows: a cancel can be lost (one that
        lands as an await inside ends), and a task left over must not re-sync forever."""
        while self._workers.get(worker) is asyncio.current_task():
            try:
                await self._sync_once(worker)
                if worker in self.others:
                    log.info("worker %x serves another model: not indexed", worker)
                    return
                log.info("kv events of worker %x ended; re-syncing", worker)
            except Exception as exc:  # a gap, a broken stream, a worker not found yet
                log.info("kv events of worker %x: %s; re-syncing", worker, exc)
            await asyncio.sleep(RESYNC_DELAY_S)

    async def _sync_once(self, worker: int) -> None:
        assert self._events is not None and self._dumps is not None
        stream = self._events.direct(None, worker)
        try:
            async with asyncio.timeout(SYNC_TIMEOUT_S):  # (not wait_for: see above)
                first: KvEventBatch = await anext(stream)
                dump_stream = self._dumps.direct(None, worker, timeout=SYNC_TIMEOUT_S)
                dump: KvDump = await anext(dump_stream)
            if dump.of_another_model(self.model):
                self.others.add(worker)
                return
            self.indexer.load_dump(worker, dump)
            self.dumps += 1
            expected = dump.last_event_id + 1
            log.debug("worker %x: %d blocks from its dump", worker, len(dump.block_hashes))
            if first.load is not None:
                self.loads[worker] = first.load
            async for batch in stream:
                for event in batch.events:
                    if event.event_id < expected:
                        continue  # in the dump already
                    if event.event_id > expected:
                        raise EventGapError(f"event {event.event_id} after {expected - 1}")
                    self.indexer.apply(worker, event)
                    expected += 1
                if batch.load is not None:
                    self.loads[worker] = batch.load
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()
