"""Decode-first, on the prefill worker: a prompt's KV written into the decode worker's blocks,
layer by layer as the engine computes it when it is the engine's `KvSink` for the request, else
(`--kv-push blocks`, or a runner that writes no layers) whole once the prompt is computed; and
the claim on those blocks that lets it write (`RoomClaim`).

The engine tells the push of each layer of each prompt chunk once that layer's K and V are in
the cache. Once the decode worker lets it write (`claimed`: it claimed the room), a writer (at
most one at a time per push, on a shared thread pool) writes the layers told since its last
write, of the chunk's blocks, into the target's blocks at the same positions in the prompt: a
block's layers are contiguous, so a writer that falls behind the forward pass moves several
layers of a block as one piece. `finish` then writes, whole, the blocks that were not streamed
(found in the prefix cache here; every block if a chunk was computed again after a preemption,
since a write may have read a block after its reuse) and reports whether all went.

Invariants: nothing is written before the room is claimed, and no write starts once the
decode worker ended the claim (`claimed(False)`); one push's writes run one at a time, in the
order the layers were computed; once `finish` or `stop` returns, none of its writes runs or
starts, and none lands after `linger_left()` more seconds (a write that failed may still
complete meanwhile, over NIXL or TCP); no write starts after `write_until`; the engine's thread
never waits on a write."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass

from kvbaton.engine.engine import KvCacheView
from kvbaton.engine.sequence import PromptChunk
from kvbaton.kv_transfer import KvTransferAgent
from kvbaton.llm.peer_calls import PeerCalls
from kvbaton.protocols.llm import KvTarget
from kvbaton.runtime import ResponseStream

log = logging.getLogger(__name__)


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
        self.num_layers = cache.num_layers
        self._cond = threading.Condition()
        self._pending: list[_Layers] = []
        self._claimed = False  # the decode worker let us write (`claimed`)
        self._writing = False
        self._stopped = False
        self._error: BaseException | None = None
        self._next_start: int | None = None
        self._redo_all = False  # a chunk was computed again: write every block whole at the end
        self._streamed: dict[int, int] = {}  # prompt block index -> block id written, all layers
        self.writes = 0  # transfers made while the prompt was computed
        self._lingers_until = 0.0  # (monotonic) a write that failed may land until then
        self.write_until = float("inf")  # (monotonic) no write starts after (`RoomClaim`)

    # -- the engine's thread -------------------------------------------------------------------
    def layer_written(self, chunk: PromptChunk, layer: int) -> None:
        with self._cond:
            if self._stopped or self._error is not None:
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
        """(Holding the lock.) A writer for the pending layers, unless one runs or the decode
        worker has not let us write yet."""
        if self._claimed and self._pending and not self._writing:
            self._writing = True
            try:
                self.writers.submit(self._drain)
            except RuntimeError as exc:  # the pool is shut down
                self._writing = False
                self._error = exc

    # -- the worker's event loop ----------------------------------------------------------------
    def claimed(self, ok: bool) -> None:
        """The decode worker let us write (`ok`), or no longer waits: nothing more is written
        (`finish` raises)."""
        with self._cond:
            self._claimed = ok
            if ok:
                self._start_writer()
            else:
                self._stopped = True

    # -- a writer thread -----------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._pending or self._stopped or self._error is not None:
                    self._writing = False
                    self._cond.notify_all()
                    return
                job = self._pending.pop(0)
            try:
                self._write(job)
            except BaseException as exc:
                room = self.target.room
                log.warning("request %s: KV write to %s failed: %s", self.request_id, room, exc)
                with self._cond:
                    self._error = exc

    def _write(self, job: _Layers) -> None:
        src: list[int] = []
        dst: list[int] = []
        for k, block in enumerate(job.chunk.block_ids):
            slot = self._slot(job.chunk.first_block + k)
            if slot is not None:
                src.append(block)
                dst.append(slot)
        if not src:
            return
        layers = (job.first, job.end)
        self.cache.stage_out(src, layers)
        self._transfer(src, dst, layers)
        self.writes += 1
        if job.end == self.num_layers:
            with self._cond:
                for k, block in enumerate(job.chunk.block_ids):
                    self._streamed[job.chunk.first_block + k] = block

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

    def _slot(self, index: int) -> int | None:
        """The target's block for the prompt's block `index` (None: the decode worker has it)."""
        k = index - self.target.first_block
        return self.target.block_ids[k] if 0 <= k < len(self.target.block_ids) else None

    # -- the worker ----------------------------------------------------------------------------
    def _quiesce(self, timeout_s: float) -> None:
        """Until no write runs (the writes still pending are dropped if stopped)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._writing, timeout_s):
                self._stopped = True
                raise TimeoutError(f"KV writes to {self.target.room} still run after {timeout_s}s")

    def stop(self) -> None:
        """No more writes (the request ended early); returns once none runs, however long the
        one running takes (each transfer is bounded by the agent's own timeout): the decode
        worker's blocks are given back only after this."""
        with self._cond:
            self._stopped = True
            waited = 0.0
            while not self._cond.wait_for(lambda: not self._writing, self.agent.timeout_s):
                waited += self.agent.timeout_s
                room = self.target.room
                log.error(
                    "request %s: a KV write to %s still runs after %gs",
                    self.request_id,
                    room,
                    waited,
                )

    def finish(self, prompt_blocks: list[int]) -> None:
        """The prompt is computed, in `prompt_blocks` (its block table): wait for the streamed
        writes, then write whole the blocks they did not cover. Raises if any write failed."""
        started = time.perf_counter()
        target = self.target
        end = target.first_block + len(target.block_ids)
        if len(prompt_blocks) < end:
            self.stop()
            raise ValueError("the decode worker's blocks do not fit this prompt's")
        self._quiesce(self.agent.timeout_s)
        with self._cond:
            if self._error is not None:
                raise self._error
            if not self._claimed:
                raise ConnectionError("the decode worker did not let us write its blocks")
            if self._stopped:  # `stop` returned: no write may start any more
                raise ConnectionError("the push was stopped")
            self._stopped = True
            missing = [
                i
                for i in range(target.first_block, end)
                if self._redo_all or self._streamed.get(i) != prompt_blocks[i]
            ]
            self._writing = True  # `stop` waits for this write too
        src = [prompt_blocks[i] for i in missing]
        dst = [target.block_ids[i - target.first_block] for i in missing]
        try:
            self.cache.stage_out(src)
            backend = self._transfer(src, dst, None)
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()
        streamed = f"layer by layer in {self.writes} writes, {len(src)} more whole, "
        log.info(
            "request %s: wrote %d KV blocks (%.2f MB) %sover %s; done %.1f ms after the prompt "
            "was computed",
            self.request_id,
            len(target.block_ids),
            len(target.block_ids) * self.cache.block_bytes / 1e6,
            streamed if self.writes else "",
            backend,
            (time.perf_counter() - started) * 1e3,
        )


class RoomClaim:
    """A prefill worker's claim on a decode worker's room, made in the background while the
    prompt is computed; `pusher` writes only once it is accepted, and stops writing if the
    decode worker ends the claim first (it stopped waiting), or once the wait it promised, from
    when the claim was sent, has passed (no word of its end may reach us: a request plane cut
    off while the KV's path is not). Held from acceptance (the decode worker reads its end as
    the end of our writes) until `report`, which tells the decode worker whether its blocks
    hold the KV, then lets go."""

    def __init__(self, peers: PeerCalls, target: KvTarget, pusher: LayerPush) -> None:
        self.peers = peers
        self.target = target
        self.pusher = pusher
        self.reported = False
        self._stream: ResponseStream | None = None
        self._takes_linger = False
        self._watch: asyncio.Task[None] | None = None
        self._task = asyncio.create_task(self._claim())

    async def _claim(self) -> bool:
        pusher = self.pusher
        sent, sent_loop = time.monotonic(), asyncio.get_running_loop().time()
        claim = await self.peers.claim(self.target, pusher.agent.timeout_s)
        if claim is not None:
            self._stream, self._takes_linger = claim.stream, claim.takes_linger
            pusher.write_until = sent + claim.wait_s  # checked as each write starts
            until = sent_loop + claim.wait_s
            self._watch = asyncio.create_task(self._watch_end(self._stream, until))
        pusher.claimed(claim is not None)
        return claim is not None

    async def _watch_end(self, stream: ResponseStream, until: float) -> None:
        """Until the claim ends, or the loop's time `until`."""
        ran_out = False
        try:
            async with asyncio.timeout_at(until):
                async for _ in stream:
                    pass
        except TimeoutError:
            ran_out = True
        except Exception:
            pass
        if not self.reported:
            why = "its wait ran out" if ran_out else "the decode worker stopped waiting"
            log.warning("room %s: %s: no more writes", self.target.room, why)
            self.pusher.claimed(False)

    async def accepted(self) -> bool:
        return await self._task

    def cancel(self) -> None:
        """Withdraw a claim not yet answered (nothing will be written)."""
        self._task.cancel()

    async def report(self, ok: bool, token_ids: list[int]) -> None:
        """Once no write runs or starts (a later call does nothing): the decode worker's blocks
        hold the prompt's KV (`ok`), or will not; `token_ids`: the first token. With it goes how
        long a write that failed may still land in them (`LayerPush.linger_left`), or, to a
        decode worker that does not take that, the report waits as long."""
        if self.reported:
            return
        self.reported = True
        self.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        linger_s = self.pusher.linger_left()
        if linger_s and not self._takes_linger:
            await asyncio.sleep(linger_s)
            linger_s = 0.0
        try:
            await self.peers.kv_ready(self.target, ok, token_ids, linger_s)
        finally:  # only now: the claim's end before the report reads as our writer's loss
            if self._watch is not None:
                self._watch.cancel()
            if self._stream is not None:
                await self._stream.aclose()
