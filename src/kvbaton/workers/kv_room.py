"""A decode-first request's room on the decode worker: the blocks its prompt's KV will be
written into, and the state of that wait (claimed by a writer, ended, written or not, whether a
write may still land). `KvHandoff` opens rooms, serves their endpoints and waits in them."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field


@dataclass
class KvRoom:
    """A decode-first request's KV source: where its prompt's KV will be written. A writer
    claims it before its first write; a claimed room ends only by its writer's report, the end
    of the writer's claim, or the long `CLAIMED_TIMEOUT_S`; an unclaimed one also when its wait
    times out, its request ends or the router abandons it, after which a claim is refused.
    `writes_end` is set once no write can land in its blocks any more: when an unclaimed room
    ends, on its writer's report, else a grace period after the room ended."""

    name: str
    allocated: asyncio.Future[None]  # resolved once the engine gave the request its blocks
    ended: asyncio.Future[None]  # resolved (on its loop) once the room ended
    block_ids: list[int] = field(default_factory=list)
    first_block: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    writes_end: threading.Event = field(default_factory=threading.Event)
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
