"""Router replica sync: the frontends that route to the same workers tell each other what they
routed (as Dynamo's router replica sync does), so that a burst spread over several frontends
does not pile onto one worker (docs/architecture.md, "Router replica sync").

- Each frontend serves `{namespace}.frontend.router_sync` on the request plane: a stream that
  starts with every request its KV routers count at that moment, then each add, prefill end
  and free as it happens (`protocols/router_sync.py`).
- Each frontend follows every other frontend's stream and counts their requests in its KV
  routers' `ActiveSequences` beside its own, keyed by (frontend, request).
- A KV router is known by its (component, model): workers of several models may register on
  one component (`kvbaton worker`'s default "backend"), each model with its own router.
- A frontend that leaves discovery, or whose stream breaks, has all its requests taken out of
  the counts at once; its stream is followed again from a new snapshot.
- Publishing never waits: a follower that falls `MAX_BACKLOG` events behind is cut off (it then
  re-syncs from a snapshot).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvbaton.protocols.router_sync import RouteEvent, RouteEventBatch, RouteEventKind
from kvbaton.router.active import ActiveSequences
from kvbaton.runtime import Client, Context, DistributedRuntime

log = logging.getLogger(__name__)

RouterId = tuple[str, str]  # (component, model)

MAX_BACKLOG = 10_000  # events queued for one follower before it is cut off
RESYNC_DELAY_S = 0.5  # between two tries at a peer's stream
RECHECK_S = 1.0  # the live peers are looked at again at least this often


@dataclass
class _Connection:
    """One stream from a peer: the requests it had counted here (dropped when it ends)."""

    id: int
    counted: set[tuple[str, str, int]] = field(default_factory=set)  # (*RouterId, key)


@dataclass(eq=False)  # (kept in a set: hashed by identity)
class _Follower:
    events: list[RouteEvent] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    behind: bool = False


class RoutePublisher:
    """What one KV router tells the other frontends (made by `ReplicaSync.register`)."""

    def __init__(self, sync: ReplicaSync, router: RouterId) -> None:
        self._sync = sync
        self._component, self._model = router

    def key(self) -> int:
        """A new request's key (unique among this frontend's)."""
        return next(self._sync.keys)

    def added(
        self, key: int, worker: int, block_hashes: Sequence[int], prefill_tokens: int
    ) -> None:
        self._publish(
            RouteEventKind.ADDED,
            key,
            worker=worker,
            block_hashes=list(block_hashes),
            prefill_tokens=prefill_tokens,
        )

    def prefilled(self, key: int) -> None:
        self._publish(RouteEventKind.PREFILLED, key)

    def freed(self, key: int) -> None:
        self._publish(RouteEventKind.FREED, key)

    def _publish(self, kind: RouteEventKind, key: int, **details: Any) -> None:
        self._sync.publish(
            RouteEvent(kind=kind, component=self._component, model=self._model, key=key, **details)
        )


class ReplicaSync:
    def __init__(self, runtime: DistributedRuntime, namespace: str) -> None:
        self.runtime = runtime
        self.endpoint = f"{namespace}.frontend.router_sync"
        self._actives: dict[RouterId, ActiveSequences] = {}  # a router's counts
        self._own: dict[tuple[str, str, int], RouteEvent] = {}  # what this frontend counts now
        self._followers: set[_Follower] = set()
        self._peers: dict[int, asyncio.Task[None]] = {}  # peer -> the task following it
        self._connections = itertools.count()
        self.keys = itertools.count()  # this frontend's requests
        self._me: int | None = None

    def register(self, router: RouterId, active: ActiveSequences) -> RoutePublisher:
        """Count the other frontends' requests of `router` in `active`; what to tell them.
        The peers' streams are followed again, from snapshots that include `router`."""
        self._actives[router] = active
        for task in self._peers.values():
            task.cancel()  # (its stream's requests leave the counts as it ends)
        self._peers.clear()
        return RoutePublisher(self, router)

    def unregister(self, router: RouterId, active: ActiveSequences) -> None:
        """Stop counting in `active` (unless a newer router of `router` took its place)."""
        if self._actives.get(router) is active:
            del self._actives[router]

    # -- this frontend's side ----------------------------------------------------------------
    def publish(self, event: RouteEvent) -> None:
        own = (event.component, event.model, event.key)
        if event.kind is RouteEventKind.ADDED:
            self._own[own] = event
        elif event.kind is RouteEventKind.PREFILLED:
            if own in self._own:
                self._own[own] = msgspec.structs.replace(self._own[own], prefill_tokens=0)
        else:
            self._own.pop(own, None)
        for follower in self._followers:
            if follower.behind:
                continue
            if len(follower.events) >= MAX_BACKLOG:
                follower.behind = True
            else:
                follower.events.append(event)
            follower.ready.set()

    async def subscribe(self, request: Any, context: Context) -> AsyncIterator[RouteEventBatch]:
        """The `router_sync` handler: every request counted now, then the changes, until the
        caller leaves or falls `MAX_BACKLOG` events behind."""
        follower = _Follower()
        self._followers.add(follower)
        try:
            yield RouteEventBatch(events=list(self._own.values()))
            while True:
                await follower.ready.wait()
                follower.ready.clear()
                if follower.behind:
                    raise RuntimeError(f"follower fell {MAX_BACKLOG} events behind; re-sync")
                events, follower.events = follower.events, []
                yield RouteEventBatch(events=events)
        finally:
            self._followers.discard(follower)

    # -- the others' side --------------------------------------------------------------------
    async def run(self) -> None:
        """Serve this frontend's stream and follow the others' until cancelled."""
        self._me = await self.runtime.ensure_instance_id()
        client = await self.runtime.endpoint(self.endpoint).client(response_type=RouteEventBatch)
        serving = asyncio.create_task(
            self.runtime.endpoint(self.endpoint).serve_endpoint(self.subscribe)
        )
        try:
            await self._follow(client)
        finally:
            tasks = [serving, *self._peers.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._peers.clear()
            await client.close()

    async def _follow(self, client: Client) -> None:
        while True:
            live = {i for i in client.instance_ids() if i != self._me}
            for peer in live - self._peers.keys():
                self._peers[peer] = asyncio.create_task(self._sync(client, peer))
            for peer in self._peers.keys() - live:
                self._peers.pop(peer).cancel()
            with contextlib.suppress(TimeoutError):  # (asyncio.timeout: see kv_events.py)
                async with asyncio.timeout(RECHECK_S):
                    await client.wait_for_change()

    async def _sync(self, client: Client, peer: int) -> None:
        while self._peers.get(peer) is asyncio.current_task():
            connection = _Connection(next(self._connections))
            stream = client.direct(None, peer)
            try:
                async for batch in stream:
                    for event in batch.events:
                        self._apply(connection, event)
                log.info("router sync of frontend %x ended; following it again", peer)
            except Exception as exc:
                log.info("router sync of frontend %x: %s; following it again", peer, exc)
            finally:
                self._drop(connection)
                with contextlib.suppress(Exception):
                    await stream.aclose()
            await asyncio.sleep(RESYNC_DELAY_S)

    def _apply(self, connection: _Connection, event: RouteEvent) -> None:
        active = self._actives.get((event.component, event.model))
        if active is None:
            return  # a model this frontend does not route (yet)
        own = (event.component, event.model, event.key)
        key = (connection.id, *own)
        if event.kind is RouteEventKind.ADDED:
            active.add(key, event.worker, event.block_hashes, event.prefill_tokens)
            connection.counted.add(own)
        elif event.kind is RouteEventKind.PREFILLED:
            active.prefill_done(key)
        else:
            active.free(key)
            connection.counted.discard(own)

    def _drop(self, connection: _Connection) -> None:
        """Take every request the stream counted out of the counts."""
        for component, model, key in connection.counted:
            active = self._actives.get((component, model))
            if active is not None:
                active.free((connection.id, component, model, key))
        connection.counted.clear()
