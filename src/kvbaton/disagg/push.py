"""Decode-first, on the prefill worker: a prompt's KV written into the decode worker's blocks
(`LayerPush`, a state machine), under a claim on them (`RoomClaim`); docs/architecture.md,
"The prefill worker's push".

- As the engine's `KvSink`, a push writes each layer of each prompt chunk once computed, at
  most one write at a time, in order; a writer that falls behind moves several layers of a
  block as one piece. `finish` writes whole the blocks not streamed (prefix-cache hits; every
  block after a preemption recomputed a chunk).
- Nothing is written before the claim is accepted, after it ended, or after `write_until`.
- Once `finish` or `stop` returns, no write runs or starts; none lands after `linger_left()`.
- The engine's thread never waits on a write.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import threading
import time
from dataclasses import dataclass

from kvbaton.disagg.peers import PeerCalls
from kvbaton.engine.connector import KvCacheView, PromptChunk
from kvbaton.kv_transfer import KvTransferAgent
from kvbaton.protocols.disagg import KvReady
from kvbaton.protocols.llm import KvTarget
from kvbaton.runtime import ResponseStream

log = logging.getLogger(__name__)


class PushState(enum.Enum):
    CLAIMING = "claiming"  # the claim is on its way: layers queue, nothing is written
    WRITING = "writing"  # claimed: layers are written as they are computed
    FINISHING = "finishing"  # the prompt is computed: the blocks not streamed are written
    SUCCESS = "success"  # every block was written
    STOPPED = "stopped"  # refused, the claim ended, stopped, or a write failed


P = PushState
TRANSITIONS: dict[PushState, frozenset[PushState]] = {
    P.CLAIMING: frozenset({P.WRITING, P.STOPPED}),
    P.WRITING: frozenset({P.FINISHING, P.STOPPED}),
    P.FINISHING: frozenset({P.SUCCESS, P.STOPPED}),
    P.SUCCESS: frozenset(),
    P.STOPPED: frozenset(),
}


@dataclass(frozen=True)
class _Layers:
    chunk: PromptChunk
    first: int
    end: int


class LayerPush:
    def __init__(
        self,
        request_id: str,
        target: KvTarget,
        agent: KvTransferAgent,
        cache: KvCacheView,
        writers: concurrent.futures.Executor,
    ) -> None:
        self.request_id = request_id
        self.target = target
        self.agent = agent
        self.cache = cache
        self.writers = writers
        self.state = P.CLAIMING
        self._error: BaseException | None = None  # why it stopped
        self._cond = threading.Condition()
        self._pending: list[_Layers] = []
        self._writing = False  # a write runs
        self._next_start: int | None = None
        self._redo_all = False  # a chunk was computed again: write every block at the end
        self._streamed: dict[int, int] = {}  # prompt block index -> block id written whole
        self.writes = 0  # transfers made while the prompt was computed
        self._lingers_until = 0.0  # (monotonic) a write that failed may land until then
        self.write_until = float("inf")  # (monotonic) no write starts after (`RoomClaim`)

    def _to(self, state: PushState, error: BaseException | None = None) -> None:
        """The one transition function (holding the lock); a finished push stays so."""
        if self.state in (P.SUCCESS, P.STOPPED):
            return
        assert state in TRANSITIONS[self.state], f"push {self.request_id}: {self.state} -> {state}"
        self.state = state
        self._error = self._error or error
        if state is P.WRITING:
            self._start_writer()

    # -- the engine's thread -------------------------------------------------------------------
    def layer_written(self, chunk: PromptChunk, layer: int) -> None:
        with self._cond:
            if self.state not in (P.CLAIMING, P.WRITING):
                return
            if layer == 0:
                if self._next_start is not None and chunk.start != self._next_start:
                    self._redo_all = True
                self._next_start = chunk.end
            last = self._pending[-1] if self._pending else None
            if last is not None and last.chunk is chunk and last.end == layer:
                self._pending[-1] = _Layers(chunk, last.first, layer + 1)
            else:
                self._pending.append(_Layers(chunk, layer, layer + 1))
            self._start_writer()

    def _start_writer(self) -> None:
        """(Holding the lock.) A writer for the pending layers, unless one runs."""
        if self.state is P.WRITING and self._pending and not self._writing:
            self._writing = True
            try:
                self.writers.submit(self._drain)
            except RuntimeError as exc:  # the pool is shut down
                self._writing = False
                self._to(P.STOPPED, exc)

    # -- the worker's event loop ----------------------------------------------------------------
    def claimed(self, ok: bool) -> None:
        """The decode worker let us write (`ok`), or no longer waits."""
        with self._cond:
            if ok:
                self._to(P.WRITING)
            elif self.state is not P.FINISHING:  # (its last write checks `write_until`)
                self._to(P.STOPPED, ConnectionError("the decode worker no longer waits"))

    # -- a writer thread -----------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._pending or self.state is not P.WRITING:
                    self._writing = False
                    self._cond.notify_all()
                    return
                job = self._pending.pop(0)
            try:
                self._write(job)
            except BaseException as exc:
                log.warning("request %s: KV write failed: %s", self.request_id, exc)
                with self._cond:
                    self._to(P.STOPPED, exc)

    def _write(self, job: _Layers) -> None:
        blocks = dict(enumerate(job.chunk.block_ids, job.chunk.first_block))
        src, dst = self._pairs(blocks)
        if not src:
            return
        self.cache.stage_out(src, (job.first, job.end))
        self._transfer(src, dst, (job.first, job.end))
        self.writes += 1
        if job.end == self.cache.num_layers:
            with self._cond:
                self._streamed.update(blocks)

    def _transfer(self, src: list[int], dst: list[int], layers: tuple[int, int] | None) -> str:
        if time.monotonic() >= self.write_until:
            raise ConnectionError(f"the decode worker may no longer wait in {self.target.room}")
        try:
            return self.agent.write(self.target.pool, src, dst, layers)
        except OSError:
            linger_s = self.agent.linger_s(self.target.pool, "write")
            with self._cond:
                self._lingers_until = max(self._lingers_until, time.monotonic() + linger_s)
            raise

    def linger_left(self) -> float:
        """Seconds until no write that failed can land any more (0 if none did)."""
        with self._cond:
            return max(0.0, self._lingers_until - time.monotonic())

    def _pairs(self, blocks: dict[int, int]) -> tuple[list[int], list[int]]:
        """Of `blocks` (the prompt's block index -> ours), ours and the target's blocks for those
        the target takes (the decode worker has those before its `first_block`)."""
        first, dst = self.target.first_block, self.target.block_ids
        pairs = [(b, dst[i - first]) for i, b in blocks.items() if 0 <= i - first < len(dst)]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    # -- the worker's wait threads --------------------------------------------------------------
    def stop(self) -> None:
        """No more writes; returns once none runs (each is bounded by the agent's timeout): the
        decode worker's blocks are given back only after this."""
        with self._cond:
            self._to(P.STOPPED, ConnectionError("the push was stopped"))
            waited = 0.0
            while not self._cond.wait_for(lambda: not self._writing, self.agent.timeout_s):
                waited += self.agent.timeout_s
                log.error("request %s: a KV write still runs after %gs", self.request_id, waited)

    def finish(self, prompt_blocks: list[int]) -> None:
        """The prompt is computed, in `prompt_blocks` (its block table): wait for the streamed
        writes, then write whole the blocks they did not cover. Raises if any write failed."""
        started = time.perf_counter()
        target = self.target
        end = target.first_block + len(target.block_ids)
        with self._cond:
            if len(prompt_blocks) < end:
                self._to(P.STOPPED, ValueError("the decode worker's blocks do not fit the prompt"))
            if not self._cond.wait_for(lambda: not self._writing, self.agent.timeout_s):
                self._to(P.STOPPED, TimeoutError(f"KV writes to {target.room} still run"))
            if self.state is not P.WRITING:
                raise self._error or ConnectionError("the decode worker did not let us write")
            self._to(P.FINISHING)
            missing = [
                i
                for i in range(target.first_block, end)
                if self._redo_all or self._streamed.get(i) != prompt_blocks[i]
            ]
            self._writing = True  # `stop` waits for this write too
        src, dst = self._pairs({i: prompt_blocks[i] for i in missing})
        error: BaseException | None = None
        try:
            self.cache.stage_out(src)
            backend = self._transfer(src, dst, None)
        except BaseException as exc:
            error = exc
            raise
        finally:
            with self._cond:
                self._to(P.STOPPED if error else P.SUCCESS, error)
                self._writing = False
                self._cond.notify_all()
        streamed = f"layer by layer in {self.writes} writes, {len(src)} more whole, "
        log.info(
            "request %s: wrote %d KV blocks (%.2f MB) %sover %s; done %.1f ms after the prompt",
            self.request_id,
            len(target.block_ids),
            len(target.block_ids) * self.cache.block_bytes / 1e6,
            streamed if self.writes else "",
            backend,
            (time.perf_counter() - started) * 1e3,
        )


class RoomClaim:
    """A prefill worker's claim on a decode worker's room, sent in the background while the
    prompt is computed.
    - `pusher` writes once it is accepted; it stops if the decode worker ends the claim, or
      once the wait it promised (counted from before the claim was sent) has passed.
    - Held from acceptance until `report`, which tells the decode worker whether its blocks
      hold the KV, then lets go."""

    def __init__(self, peers: PeerCalls, target: KvTarget, pusher: LayerPush) -> None:
        self.peers = peers
        self.target = target
        self.pusher = pusher
        self.reported = False
        self._stream: ResponseStream | None = None
        self._watch: asyncio.Task[None] | None = None
        self._task = asyncio.create_task(self._claim())

    async def _claim(self) -> bool:
        sent, sent_loop = time.monotonic(), asyncio.get_running_loop().time()
        claim = await self.peers.claim(self.target, self.pusher.agent.timeout_s)
        if claim is not None:
            self._stream = claim.stream
            self.pusher.write_until = sent + claim.wait_s  # checked as each write starts
            self._watch = asyncio.create_task(self._watch_end(sent_loop + claim.wait_s))
        self.pusher.claimed(claim is not None)
        return claim is not None

    async def _watch_end(self, until: float) -> None:
        """Until the claim ends, or the loop's time `until`."""
        assert self._stream is not None
        why = "the decode worker stopped waiting"
        try:
            async with asyncio.timeout_at(until):
                async for _ in self._stream:
                    pass
        except TimeoutError:
            why = "its wait ran out"
        except Exception:
            pass
        if not self.reported:
            log.warning("room %s: %s: no more writes", self.target.room, why)
            self.pusher.claimed(False)

    async def accepted(self) -> bool:
        return await self._task

    def cancel(self) -> None:
        """Withdraw a claim not yet answered (nothing will be written)."""
        self._task.cancel()

    async def report(self, ok: bool, token_ids: list[int]) -> None:
        """Once no write runs or starts (a later call does nothing): whether the decode worker's
        blocks hold the prompt's KV, with how long a write that failed may still land."""
        if self.reported:
            return
        self.reported = True
        self.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        report = KvReady(
            room=self.target.room, ok=ok, token_ids=token_ids, linger_s=self.pusher.linger_left()
        )
        try:
            await self.peers.ready(self.target, report)
        finally:  # only now: the claim's end before the report reads as our writer's loss
            if self._watch is not None:
                self._watch.cancel()
            if self._stream is not None:
                await self._stream.aclose()
