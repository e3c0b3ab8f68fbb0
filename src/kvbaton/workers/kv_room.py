"""A decode worker's side of decode-first disaggregation: each request's room (`KvRoom`: the
blocks its prompt's KV will be written into, and the state of that wait: claimed by a writer,
ended, written or not, whether a write may still land), and the rooms it has open (`KvRooms`:
opened and closed with their requests, claimed and reported on through the `kv_claim` and
`kv_ready` endpoints, waited in by the engine's load). See `kv_handoff` for the invariants."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvbaton.engine.engine import KvCacheView
from kvbaton.engine.scheduler import KvLoad, KvLoadFailed
from kvbaton.kv_transfer import KvTransferAgent
from kvbaton.llm.peer_calls import CLAIMED_TIMEOUT_S, seconds
from kvbaton.protocols.llm import KvTarget
from kvbaton.runtime import Context, DistributedRuntime

log = logging.getLogger(__name__)

WRITES_END_MARGIN_S = 1.0  # for the writer to see its claim end (one hop) and stop


class ReclaimingEngine(Protocol):
    def reclaim_kv_blocks(self) -> None: ...


@dataclass
class KvRoom:
    """A decode-first request's KV source: where its prompt's KV will be written. A writer
    claims it before its first write; a claimed room ends only by its writer's report, the end
    of the writer's claim, or the long `CLAIMED_TIMEOUT_S`; an unclaimed one also when its wait
    times out, its request ends or the router abandons it, after which a claim is refused.
    `writes_end` is set once no write can land in its blocks any more: when an unclaimed room
    ends, on its writer's report (or the linger it names after it), else a grace period after
    the room ended."""

    name: str
    allocated: asyncio.Future[None]  # resolved once the engine gave the request its blocks
    ended: asyncio.Future[None]  # resolved (on its loop) once the room ended
    block_ids: list[int] = field(default_factory=list)
    first_block: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    writes_end: threading.Event = field(default_factory=threading.Event)
    writes_end_at: float = 0.0  # (loop time) when `writes_end` is due, if a timer will set it
    claimed: bool = False
    writer_timeout_s: float = 0.0  # its transfers' timeout, as its claim said
    ok: bool = False
    token_ids: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def end(self, ok: bool, token_ids: list[int]) -> bool:
        """The first end counts; False for a later one."""
        with self._lock:
            if self.done.is_set():
                return False
            self.ok, self.token_ids = ok, token_ids
            self._set_done()
            return True

    def report(self, ok: bool, token_ids: list[int]) -> bool:
        """The writer's report (its writes have ended): `end`, and no write can land any more
        (even if the room ended before)."""
        self.writes_end.set()  # first: whoever sees the room ended sees this too
        return self.end(ok, token_ids)

    def claim(self) -> bool:
        """A writer may write the room's blocks (once, and only while it is open)."""
        with self._lock:
            if self.done.is_set() or self.claimed:
                return False
            self.claimed = True
            return True

    def expire(self) -> bool:
        """End the room unless a writer claimed it; whether it is ended."""
        with self._lock:
            if not self.claimed and not self.done.is_set():
                self._set_done()
            return self.done.is_set()

    def _set_done(self) -> None:
        """(Holding the lock; on any thread.)"""
        self.done.set()
        if not self.claimed:
            self.writes_end.set()
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody awaits `ended`
            self.ended.get_loop().call_soon_threadsafe(self._resolve_ended)

    def _resolve_ended(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)


class KvRooms:
    def __init__(
        self,
        runtime: DistributedRuntime,
        engine: ReclaimingEngine,
        agent: KvTransferAgent,
        cache: KvCacheView,
        component_path: str,
        block_size: int,
    ) -> None:
        """`component_path`: "namespace.component" of this worker (its kv_claim and kv_ready
        endpoints)."""
        self.runtime = runtime
        self.engine = engine
        self.agent = agent
        self.cache = cache
        self.claim_endpoint = f"{component_path}.kv_claim"
        self.notify_endpoint = f"{component_path}.kv_ready"
        self.block_size = block_size
        self._rooms: dict[str, KvRoom] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    def close(self) -> None:
        """End every room (the engine stops: nothing reuses their blocks)."""
        for room in list(self._rooms.values()):
            room.end(False, [])
            room.writes_end.set()
        self._rooms.clear()

    def open_room(self, name: str) -> KvRoom:
        loop = asyncio.get_running_loop()
        room = KvRoom(name, loop.create_future(), loop.create_future())
        self._rooms[name] = room
        return room

    def close_room(self, room: KvRoom) -> None:
        """The request ended. A room a writer claimed stays open until the writer is done: the
        engine keeps the blocks of an aborted request until its load ends, so no write lands in
        blocks given to another request meanwhile."""
        if not room.allocated.done():
            room.allocated.cancel()
        if room.expire() and room.writes_end.is_set():
            self._rooms.pop(room.name, None)

    def _wait_for_writes(self, room: KvRoom) -> None:
        """(On the loop.) A claimed room ended without its writer's report: its writes may
        still land until the writer sees its claim end (it starts none after) and its transfer
        in flight ends and no longer lingers: within the larger of the two sides' transfer
        timeouts, taken three times (a transfer, then up to twice that while a failed one may
        still land, `KvTransferAgent.linger_s`), plus `WRITES_END_MARGIN_S`. The room stays to
        take a late report (whose linger may keep the blocks out longer); the engine keeps the
        blocks out of use meanwhile (`KvLoadFailed`)."""
        bound = 3 * max(self.agent.timeout_s, room.writer_timeout_s) + WRITES_END_MARGIN_S
        self._writes_end_in(room, bound)

    def _writes_end_in(self, room: KvRoom, seconds: float) -> None:
        """(On the loop.) Set the room's `writes_end` in `seconds`, or later if a later time
        is due already (a report without a linger sets it at once)."""
        assert self._loop is not None
        at = self._loop.time() + seconds
        room.writes_end_at = max(room.writes_end_at, at)
        self._loop.call_at(at, self._writes_ended, room, at)

    def _writes_ended(self, room: KvRoom, at: float) -> None:
        if at < room.writes_end_at:
            return  # a later time is due: its own timer sets it
        if not room.writes_end.is_set():
            room.writes_end.set()
            self.engine.reclaim_kv_blocks()
        self._forget(room)

    def _forget(self, room: KvRoom) -> None:
        if self._rooms.get(room.name) is room:
            del self._rooms[room.name]

    def target(self, room: KvRoom) -> KvTarget:
        """The room's blocks, for the PrefillRouter to hand a prefill worker (its writer)."""
        return KvTarget(
            decode_instance_id=self.runtime.instance_id or 0,
            claim_endpoint=self.claim_endpoint,
            notify_endpoint=self.notify_endpoint,
            room=room.name,
            block_ids=room.block_ids,
            first_block=room.first_block,
            block_size=self.block_size,
            pool=self.agent.info(),
        )

    def await_push(self, load: KvLoad, room: KvRoom) -> list[int]:
        """Publish the room's blocks, then wait for the writer's report (or the timeout)."""
        room.block_ids, room.first_block = load.dst_blocks, load.first_block
        assert self._loop is not None

        def allocated() -> None:
            if not room.allocated.done():
                room.allocated.set_result(None)

        self._loop.call_soon_threadsafe(allocated)
        claimed = not room.done.wait(self.agent.timeout_s) and not room.expire()
        # Claimed: the prefill worker computes and writes, then reports (or its claim ends).
        if claimed and not room.done.wait(CLAIMED_TIMEOUT_S) and room.end(False, []):
            log.warning("room %s: no report after %.0fs", room.name, CLAIMED_TIMEOUT_S)
            self._loop.call_soon_threadsafe(self._wait_for_writes, room)
        if room.writes_end.is_set():
            self._loop.call_soon_threadsafe(self._forget, room)
        if not room.ok:
            raise KvLoadFailed(
                f"room {room.name}: the prompt's KV was not written",
                room.token_ids,
                room.writes_end,
            )
        self.cache.stage_in(load.dst_blocks)
        return room.token_ids

    async def kv_claim(
        self, request: Any, context: Context
    ) -> AsyncIterator[dict[str, bool | float]]:
        """Endpoint: a prefill worker claims `room` before its first write. Accepted, the stream
        stays open until the room ends, which a report or the claim's end aside is at least
        `wait_s` after the claim (a claim comes before `await_push`'s first wait ends, and
        its second lasts CLAIMED_TIMEOUT_S): the writer starts no write after that, even if
        the end does not reach it. If the caller ends the stream first (it left without a
        report, or its process or connection went), no write can come any more: the room ends
        as not written. (Not covered: a claim's end that only this side sees, a connection
        reset at this end alone; the writer may then write until `wait_s` has passed.)"""
        if not isinstance(request, dict) or not isinstance(request.get("room"), str):
            raise ValueError("kv_claim takes {'room': str, 'timeout_s': float}")
        writer_timeout_s = seconds(request.get("timeout_s", 0.0), "kv_claim's timeout_s")
        room = self._rooms.get(request["room"])
        if room is None or not room.claim():
            yield {"accepted": False}
            return
        room.writer_timeout_s = writer_timeout_s
        yield {"accepted": True, "wait_s": CLAIMED_TIMEOUT_S, "linger": True}
        stopped = asyncio.ensure_future(context.stopped())
        try:
            await asyncio.wait((stopped, room.ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if room.end(False, []):
            log.warning("room %s: its writer let go without a report", room.name)
            self._wait_for_writes(room)

    async def kv_ready(self, request: Any, context: Context) -> dict[str, bool]:
        """Endpoint: the prefill worker reports that it wrote the KV of `room` (ok) or will
        not, and that its writes have ended, or will have in `linger_s` (a write that failed
        may still land until then); or the router abandons it (`abandon`: no prefill worker
        will come, which ends the room unless a writer claimed it)."""
        if not isinstance(request, dict) or not isinstance(request.get("room"), str):
            raise ValueError(
                "kv_ready takes {'room': str, 'ok': bool, 'token_ids': [int], 'linger_s': float}"
                " or {'room': str, 'abandon': true}"
            )
        name = request["room"]
        if request.get("abandon"):
            room = self._rooms.get(name)
            if room is None or not room.expire():
                return {"accepted": False}  # its writer will report, or its claim end
            self._rooms.pop(name, None)
            return {"accepted": True}
        if not isinstance(request.get("ok"), bool):  # (a claim goes to kv_claim)
            raise ValueError("a kv_ready report takes 'ok': bool")
        linger_s = seconds(request.get("linger_s", 0.0), "a kv_ready report's linger_s")
        room = self._rooms.pop(name, None)
        if room is None:
            return {"accepted": False}
        token_ids = [int(t) for t in request.get("token_ids", [])]
        writes_were_pending = not room.writes_end.is_set()
        if linger_s > 0 and writes_were_pending:  # not written, and writes may still land
            accepted = room.end(False, token_ids)
            self._writes_end_in(room, linger_s)
            return {"accepted": accepted}
        accepted = room.report(request["ok"], token_ids)
        if writes_were_pending and not accepted:  # a late report: its blocks may be reused
            self.engine.reclaim_kv_blocks()
        return {"accepted": accepted}
