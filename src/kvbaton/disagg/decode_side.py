"""The decode worker's side of disaggregation (docs/architecture.md): the prompt's KV is read
from the prefill worker's pool (prefill-first, `KvFetch`), or written into blocks it
allocated first (decode-first, its room: `rooms.py`).

- One release per request it was given params for: after its read, or when the request ends
  without one.
- What was read is kept only if the prefill worker held the blocks until after the read (its
  hold may time out while the request queues here); else the prompt is computed here.
- The blocks of a read that failed stay out of use while it may still land
  (`KvTransferAgent.linger_s`).
- Each read is counted once, by how it ended (`DecodeSide.reads_ended`, `READ_ENDINGS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Literal

from kvbaton.disagg.peers import CALL_TIMEOUT_S
from kvbaton.disagg.rooms import Room, Rooms
from kvbaton.engine.connector import EngineRequest, KvLoad, KvLoadFailed, outputs_of
from kvbaton.protocols.llm import DisaggregatedParams, EngineOutput

log = logging.getLogger(__name__)

ReadEnding = Literal["read", "hold_ended", "read_failed", "request_ended"]
READ_ENDINGS: dict[ReadEnding, str] = {
    "read": "the prompt's KV was read and used",
    "hold_ended": "the prefill worker's hold ended before the read did, or it did not answer "
    "the release: not used",
    "read_failed": "the read failed",
    "request_ended": "its request ended during the read: not used",
}


@dataclass(eq=False)
class KvFetch:
    """A prefill-first request's KV source: blocks held at a prefill worker."""

    params: DisaggregatedParams
    side: DecodeSide
    released: bool = False

    def load(self, load: KvLoad) -> list[int]:
        """(On a load thread.) Read the blocks, then release them at the prefill worker."""
        side, params = self.side, self.params
        src = params.block_ids[load.first_block : load.first_block + len(load.dst_blocks)]
        try:
            if len(src) != len(load.dst_blocks):
                raise ValueError("the prefill worker sent fewer blocks than the prompt needs")
            started = time.perf_counter()
            backend = side.agent.read(params.pool, src, load.dst_blocks)
        except BaseException as exc:
            side.count_read("read_failed")
            asyncio.run_coroutine_threadsafe(self.release(), side.loop)
            linger_s = side.agent.linger_s(params.pool, "read") if isinstance(exc, OSError) else 0
            if linger_s:  # the read may still land in our blocks: keep them out of use
                ends = side.ends_in(linger_s)
                raise KvLoadFailed(f"request {load.request_id}: {exc}", writes_end=ends) from exc
            raise
        log.info(
            "request %s: read %d KV blocks (%.2f MB) over %s in %.1f ms",
            load.request_id,
            len(src),
            len(src) * side.cache.block_bytes / 1e6,
            backend,
            (time.perf_counter() - started) * 1e3,
        )
        held = asyncio.run_coroutine_threadsafe(self.release(), side.loop)
        try:
            still_held = held.result(CALL_TIMEOUT_S + 1.0)
        except TimeoutError:
            still_held = False
        if still_held is None:
            side.count_read("request_ended")
            raise KvLoadFailed(f"request {load.request_id}: it ended during the read")
        if not still_held:
            side.count_read("hold_ended")
            raise KvLoadFailed(
                f"request {load.request_id}: the prefill worker no longer held the KV when "
                "the read ended"
            )
        side.cache.stage_in(load.dst_blocks)
        side.count_handoff(started)
        side.count_read("read")
        return []

    async def release(self) -> bool | None:
        """Release the blocks at the prefill worker (once); whether it held them until now, or
        None if they were released before (the request ended)."""
        if self.released:
            return None
        self.released = True
        return await self.side.peers.release(self.params)


class DecodeSide(Rooms):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads_ended: dict[ReadEnding, int] = dict.fromkeys(READ_ENDINGS, 0)  # since start

    def count_read(self, how: ReadEnding) -> None:
        """(Any thread.) A prefill-first read ended `how`."""
        with self._count_lock:
            self.reads_ended[how] += 1

    def ends_in(self, seconds: float) -> threading.Event:
        """An event set in `seconds`, after which the engine frees the blocks it kept out."""
        ended = threading.Event()

        def end() -> None:
            ended.set()
            self.engine.reclaim_kv_blocks()

        with contextlib.suppress(RuntimeError):  # the loop closed: the engine stops
            self.loop.call_soon_threadsafe(self.loop.call_later, seconds, end)
        return ended

    async def fetched(
        self, request: EngineRequest, params: DisaggregatedParams
    ) -> AsyncGenerator[EngineOutput, None]:
        """Prefill-first: the outputs of a request whose KV waits at a prefill worker (read
        here if the blocks fit, else computed here)."""
        fetch = KvFetch(params, self)
        if params.block_size == self.block_size:
            request.kv_source = fetch
        else:
            log.info("KV of %s is not readable here; prefilling locally", params.handle)
        request.output_token_ids = list(params.first_token_ids)
        try:
            async with contextlib.aclosing(outputs_of(self.engine, request)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            await self.shielded(fetch.release())

    async def bootstrapped(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Decode-first: the request's outputs, the first of them its room's `kv_target` once
        its blocks are allocated (never, if its prompt was all cached here)."""
        room = self.open(request.request_id)
        request.kv_source = room
        streams: list[AsyncGenerator[EngineOutput, None]] = []
        try:
            outputs = await self.engine.add_request(request)
            streams = [self._announced(room, outputs), outputs]
            async for out in streams[0]:
                yield out
        finally:  # even if cancelled again (a drain): the room must close
            await self.shielded(self._close(room, streams))

    async def _close(self, room: Room, streams: list[AsyncGenerator[EngineOutput, None]]) -> None:
        for stream in streams:  # outermost first
            await stream.aclose()
        self.close_room(room)

    async def _announced(
        self, room: Room, outputs: AsyncGenerator[EngineOutput, None]
    ) -> AsyncGenerator[EngineOutput, None]:
        first = asyncio.ensure_future(anext(outputs))
        try:
            either: list[asyncio.Future[Any]] = [room.announced, first]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if room.announced.done() and not room.announced.cancelled():
                yield EngineOutput(request_id=room.name, token_ids=[], kv_target=self.target(room))
            yield await first
        finally:
            if not first.done():
                first.cancel()
                await asyncio.wait([first])  # `outputs` runs no more: it can be closed
        async for out in outputs:
            yield out
