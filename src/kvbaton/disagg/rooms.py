"""Decode-first, on the decode worker: each request's room, the blocks its prompt's KV will be
written into, as a state machine (docs/architecture.md, "The decode worker's room").

- A room changes state only on the event loop, through `Rooms._enter` and `TRANSITIONS`.
- A writer claims a room before its first write; one room, one writer.
- A claimed room ends only by its writer's report, the end of its writer's claim, or
  `CLAIMED_TIMEOUT_S`; never by its request's end or the router's abandon.
- A room's blocks are never freed or computed into while a write may still land in them
  (LINGERING): the engine keeps them out of use until `writes_end` is set.
- Each room's end is counted once, by how it ended (`Rooms.rooms_ended`, `ROOM_ENDINGS`);
  not those still open when the engine stops.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from kvbaton.disagg import peers
from kvbaton.disagg.side import Side
from kvbaton.engine.connector import KvLoad, KvLoadFailed
from kvbaton.protocols.disagg import Accepted, KvAbandon, KvClaim, KvClaimAnswer, KvReady
from kvbaton.protocols.llm import KvTarget
from kvbaton.runtime import Context
from kvbaton.runtime.request_plane import Handler

log = logging.getLogger(__name__)

WRITES_END_MARGIN_S = 1.0  # for the writer to see its claim end (one hop) and stop


class RoomState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # opened with its request; no blocks yet
    WAITING = "waiting"  # its blocks announced; waits for a writer's claim
    TRANSFERRING = "transferring"  # claimed: its writer writes, then reports
    SUCCESS = "success"  # the prompt's KV was written
    LINGERING = "lingering"  # ended unwritten; a write may still land
    FAILED = "failed"  # ended unwritten; no write can land


S = RoomState
TRANSITIONS: dict[RoomState, frozenset[RoomState]] = {
    S.BOOTSTRAPPING: frozenset({S.WAITING, S.FAILED}),
    S.WAITING: frozenset({S.TRANSFERRING, S.FAILED}),
    S.TRANSFERRING: frozenset({S.SUCCESS, S.LINGERING, S.FAILED}),
    S.LINGERING: frozenset({S.LINGERING, S.FAILED}),
    S.SUCCESS: frozenset(),
    S.FAILED: frozenset(),
}
ENDED = frozenset({S.SUCCESS, S.LINGERING, S.FAILED})
RoomEnding = Literal["written", "write_failed", "writer_lost", "writer_silent", "unclaimed"]
ROOM_ENDINGS: dict[RoomEnding, str] = {
    "written": "its writer wrote the prompt's KV",
    "write_failed": "its writer reported that the write failed",
    "writer_lost": "its writer's claim ended without a report (its process or connection went)",
    "writer_silent": f"its writer sent no report in {peers.CLAIMED_TIMEOUT_S:g} s",
    "unclaimed": "no writer claimed it (its request ended, the router gave up, or it timed out)",
}


@dataclass(eq=False)
class Room:
    """A decode-first request's KV source (`KvSource`)."""

    name: str
    rooms: Rooms
    announced: asyncio.Future[None]  # resolved once its blocks were allocated
    state: RoomState = S.BOOTSTRAPPING
    block_ids: list[int] = field(default_factory=list)
    first_block: int = 0
    token_ids: list[int] = field(default_factory=list)  # sampled by its writer
    writer_timeout_s: float = 0.0  # its writer's transfers' timeout, as its claim said
    linger_until: float = 0.0  # (loop time) LINGERING ends then
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    done: threading.Event = field(default_factory=threading.Event)  # ended (any thread)
    writes_end: threading.Event = field(default_factory=threading.Event)
    timer: asyncio.TimerHandle | None = None

    def load(self, load: KvLoad) -> list[int]:
        """(On a load thread.) Announce the room's blocks, then wait for it to end."""
        self.block_ids, self.first_block = load.dst_blocks, load.first_block
        rooms = self.rooms
        rooms.loop.call_soon_threadsafe(rooms.announce, self)
        bound = rooms.agent.timeout_s + peers.CLAIMED_TIMEOUT_S + rooms.linger_bound_s(self)
        if not self.done.wait(2 * bound) or self.state is not S.SUCCESS:
            why = "was not written" if self.done.is_set() else "never ended"
            raise KvLoadFailed(f"room {self.name}: {why}", self.token_ids, self.writes_end)
        rooms.cache.stage_in(load.dst_blocks)
        return self.token_ids


class Rooms(Side):
    """The decode worker's open rooms, and its `kv_claim`, `kv_ready` and `kv_abandon`
    endpoints."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rooms: dict[str, Room] = {}
        self.rooms_ended: dict[RoomEnding, int] = dict.fromkeys(ROOM_ENDINGS, 0)  # since start

    def endpoints(self) -> dict[str, tuple[Handler, type]]:
        return {
            "kv_claim": (self.kv_claim, KvClaim),
            "kv_ready": (self.kv_ready, KvReady),
            "kv_abandon": (self.kv_abandon, KvAbandon),
        }

    def _timeout_s(self, room: Room) -> float | None:
        """How long `room` may stay in its state (None: no bound here)."""
        return {
            S.WAITING: self.agent.timeout_s,
            S.TRANSFERRING: peers.CLAIMED_TIMEOUT_S,
            S.LINGERING: room.linger_until - self.loop.time(),
        }.get(room.state)

    def _enter(self, room: Room, state: RoomState, token_ids: list[int] | None = None) -> None:
        """The one transition function. `token_ids`: sampled by the writer, kept if this
        ends the room."""
        assert state in TRANSITIONS[room.state], f"room {room.name}: {room.state} -> {state}"
        was, room.state = room.state, state
        if room.timer is not None:
            room.timer.cancel()
        if (timeout_s := self._timeout_s(room)) is not None:
            room.timer = self.loop.call_later(timeout_s, self._timed_out, room, state)
        if was is S.BOOTSTRAPPING and not room.announced.done():
            room.announced.cancel()
        if state in ENDED and was not in ENDED:
            room.token_ids = token_ids or []
            room.done.set()
            room.ended.set()
        if state in (S.SUCCESS, S.FAILED):
            room.writes_end.set()
            self._rooms.pop(room.name, None)
            if was is S.LINGERING:  # its blocks were kept out of use: free them
                self.engine.reclaim_kv_blocks()

    def _end(
        self, room: Room, state: RoomState, how: RoomEnding, token_ids: list[int] | None = None
    ) -> None:
        """`_enter` an ended `state`, counting `how` if the room had not ended yet."""
        if room.state not in ENDED:
            self.rooms_ended[how] += 1
        self._enter(room, state, token_ids)

    def _timed_out(self, room: Room, state: RoomState) -> None:
        if room.state is not state:
            return
        if state is S.TRANSFERRING:
            log.warning("room %s: no report after %.0fs", room.name, peers.CLAIMED_TIMEOUT_S)
            self._linger(room, self.linger_bound_s(room), "writer_silent")
        elif state is S.WAITING:
            self._end(room, S.FAILED, "unclaimed")
        else:  # LINGERING ran out: no write can land any more
            self._enter(room, S.FAILED)

    def linger_bound_s(self, room: Room) -> float:
        """How long writes may land after a claim ended without a report: the writer sees its
        claim end and starts none, its transfer in flight ends and may linger twice that
        (`KvTransferAgent.linger_s`), for the larger of the two sides' transfer timeouts."""
        return 3 * max(self.agent.timeout_s, room.writer_timeout_s) + WRITES_END_MARGIN_S

    def _linger(
        self, room: Room, seconds: float, how: RoomEnding, token_ids: list[int] | None = None
    ) -> None:
        room.linger_until = max(room.linger_until, self.loop.time() + seconds)
        self._end(room, S.LINGERING, how, token_ids)

    def open(self, name: str) -> Room:
        room = Room(name, self, self.loop.create_future())
        self._rooms[name] = room
        return room

    def announce(self, room: Room) -> None:
        """Its blocks are allocated (`room.block_ids`)."""
        if room.state is S.BOOTSTRAPPING:
            room.announced.set_result(None)
            self._enter(room, S.WAITING)

    def close_room(self, room: Room | None) -> bool:
        """No writer will come (its request ended, or the router abandoned it): a room no writer
        claimed ends (True); a claimed one waits for its writer (the engine keeps an aborted
        request's blocks until its load ends)."""
        if room is None or room.state not in (S.BOOTSTRAPPING, S.WAITING):
            return False
        self._end(room, S.FAILED, "unclaimed")
        return True

    async def close(self) -> None:
        """End every room (the engine stops: nothing reuses their blocks)."""
        for room in list(self._rooms.values()):
            self._enter(room, S.FAILED)
        await super().close()

    def target(self, room: Room) -> KvTarget:
        """The room's blocks, for the PrefillRouter to hand a prefill worker (its writer)."""
        return KvTarget(
            decode_instance_id=self.runtime.instance_id or 0,
            decode_component=self.component,
            room=room.name,
            block_ids=room.block_ids,
            first_block=room.first_block,
            block_size=self.block_size,
            pool=self.agent.info(),
        )

    async def kv_claim(self, claim: KvClaim, context: Context) -> AsyncIterator[KvClaimAnswer]:
        """Endpoint. Accepted, the stream stays open until the room ends: at least `wait_s`
        after the claim, unless reported. The writer closing it (it left, or its process or
        connection went) means no write comes any more: the room lingers, not written."""
        room = self._rooms.get(claim.room)
        if room is None or room.state is not S.WAITING:
            yield KvClaimAnswer(accepted=False)
            return
        room.writer_timeout_s = claim.timeout_s
        self._enter(room, S.TRANSFERRING)
        yield KvClaimAnswer(accepted=True, wait_s=peers.CLAIMED_TIMEOUT_S)
        waits = [asyncio.ensure_future(context.stopped()), asyncio.ensure_future(room.ended.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if room.state not in ENDED:  # (still TRANSFERRING)
            log.warning("room %s: its writer let go without a report", room.name)
            self._linger(room, self.linger_bound_s(room), "writer_lost")

    async def kv_ready(self, report: KvReady, context: Context) -> Accepted:
        """Endpoint: the writer's report. Accepted if it ended the room."""
        room = self._rooms.get(report.room)
        if room is None:
            return Accepted(accepted=False)
        was = room.state
        if report.linger_s > 0 and was in (S.TRANSFERRING, S.LINGERING):
            self._linger(room, report.linger_s, "write_failed", list(report.token_ids))
        else:
            tokens = list(report.token_ids)
            if report.ok and was is S.TRANSFERRING:
                self._end(room, S.SUCCESS, "written", tokens)
            elif was in (S.BOOTSTRAPPING, S.WAITING):  # (a report with no claim accepted)
                self._end(room, S.FAILED, "unclaimed", tokens)
            else:
                self._end(room, S.FAILED, "write_failed", tokens)
        return Accepted(accepted=was not in ENDED)

    async def kv_abandon(self, abandon: KvAbandon, context: Context) -> Accepted:
        """Endpoint: no prefill worker will come (`close_room`)."""
        return Accepted(accepted=self.close_room(self._rooms.get(abandon.room)))
