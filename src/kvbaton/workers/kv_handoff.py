"""A worker's part in disaggregation (steps S5 and S7-S8), in both transfer orders.

Prefill-first: a prefill worker holds a request's blocks after its first token and answers with
`DisaggregatedParams`; the decode worker reads the prompt's KV from its pool, then tells it to
release. Decode-first: the decode worker allocates blocks and answers first with a `KvTarget`
(its room); the prefill worker claims the room (`kv_claim`, a stream it holds open while it may
write), writes the prompt's KV into its blocks (layer by layer as it computes them,
`kv_push.py`, unless told to write whole blocks at the end), tells the decode worker
(`kv_ready`, with the first token), lets go of the claim and frees its own blocks. The decode
worker waits for that in its room: for a claim at most `timeout_s`, then, claimed, for the
report or the claim's end (`KvRooms`, in kv_room.py).

Invariants:
- held blocks are released exactly once, by a `kv_release` call or, if none comes, after
  `hold_timeout_s`; a request that ends while its blocks are staged out (before its answer is
  made) holds nothing: they are released once the copy ended.
- a decode-first request's blocks are released once its push ended and no write reads them,
  however the request ends.
- a decode worker sends one release per request it was given params for (after its read, or
  when the request ends without one), keeps what it read only if the answer says the blocks
  were held until then (else it prefills the prompt itself), and keeps the blocks of a read
  that failed out of use while it may still land (`KvTransferAgent.linger_s`, NIXL).
- a room ends exactly once, and a claimed one only by its writer's report, the end of its
  writer's claim (the writer left, or its process or connection went) or the long timeout,
  never by the router's abandon; a room that ended refuses a claim.
- a room's blocks are neither freed nor computed into here while a write may still land in
  them (`KvRoom.writes_end`: the engine keeps a loading request's blocks until its load ends,
  and then, if writes may still land, quarantines them while the request goes on in other
  blocks).
- a prefill worker writes only into a room it claimed, starts no write later than the wait the
  decode worker promised (counted from before it sent the claim, so even when no word of the
  room's end reaches it), and reports (`kv_ready`) on every decode-first request its engine
  took, once no write runs or starts (saying how long one that failed may still land), before
  it lets go of the claim (one its engine refused never claims: the router abandons it)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvbaton.engine.config import EngineConfig
from kvbaton.engine.engine import KvCacheView
from kvbaton.engine.scheduler import KvLoad, KvLoadFailed
from kvbaton.kv_transfer import KvTransferAgent
from kvbaton.llm.peer_calls import CALL_TIMEOUT_S, PeerCalls
from kvbaton.protocols.llm import DisaggregatedParams, EngineOutput, KvTarget
from kvbaton.runtime import Context, DistributedRuntime
from kvbaton.workers.kv_push import LayerPush, RoomClaim
from kvbaton.workers.kv_room import KvRoom, KvRooms, ReclaimingEngine

log = logging.getLogger(__name__)

DEFAULT_HOLD_TIMEOUT_S = 30.0
PUSH_MODES = ("layers", "blocks")
DEFAULT_MAX_PUSHES = EngineConfig.max_num_seqs


class HoldingEngine(ReclaimingEngine, Protocol):
    def release_kv(self, request_id: str) -> None: ...


@dataclass
class KvFetch:
    """A decode request's KV source, as the engine hands it to the loader."""

    params: DisaggregatedParams
    released: bool = False


class KvHandoff:
    def __init__(
        self,
        runtime: DistributedRuntime,
        engine: HoldingEngine,
        agent: KvTransferAgent,
        cache: KvCacheView,
        component_path: str,
        block_size: int,
        hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S,
        push: str = "layers",
        max_pushes: int = DEFAULT_MAX_PUSHES,
    ) -> None:
        """`cache`: the engine's, whose blocks the agent's pool holds (or mirrors);
        `component_path`: "namespace.component" of this worker (its kv_release, kv_claim and
        kv_ready endpoints); `push`: how a prefill worker writes decode-first KV ("layers": as the
        engine computes each layer; "blocks": whole blocks once the prompt is computed);
        `max_pushes`: how many prompts the engine computes at once (its max_num_seqs), each of
        whose pushes gets a writer thread of its own and one to wait for its writes in, so
        that a write stalled on one decode worker (up to the transfer timeout) holds up no
        other (nor the event loop's default executor)."""
        if hold_timeout_s <= 0:
            raise ValueError("the KV hold timeout must be positive")
        if push not in PUSH_MODES:
            raise ValueError(f"the KV push must be one of {', '.join(PUSH_MODES)}")
        self.runtime = runtime
        self.engine = engine
        self.agent = agent
        self.cache = cache
        self.release_endpoint = f"{component_path}.kv_release"
        self.block_size = block_size
        self.hold_timeout_s = hold_timeout_s
        self._held: dict[str, asyncio.TimerHandle] = {}
        self.rooms = KvRooms(runtime, engine, agent, cache, component_path, block_size)
        self.peers = PeerCalls(runtime)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.push_layers = push == "layers"
        self.handoffs = 0  # prompts whose KV was read or written here (see WorkerLoad)
        self.handoff_wait_s = 0.0
        self._count_lock = threading.Lock()
        self._writers = concurrent.futures.ThreadPoolExecutor(
            max_pushes, thread_name_prefix="kvbaton-kv-push"
        )
        self._waits = concurrent.futures.ThreadPoolExecutor(
            max_pushes, thread_name_prefix="kvbaton-kv-push-wait"
        )

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.rooms.start()

    async def close(self) -> None:
        for timer in self._held.values():
            timer.cancel()
        self._held.clear()
        self.rooms.close()
        await self.peers.close()
        await asyncio.to_thread(self._writers.shutdown)
        await asyncio.to_thread(self._waits.shutdown)
        await asyncio.to_thread(self.agent.close)

    # -- prefill side --------------------------------------------------------------------------
    async def hold(self, handle: str, out: EngineOutput, prompt_len: int) -> EngineOutput:
        """The answer for a held request: its first token and where its KV waits.
        - If the blocks cannot be staged out (cancelled meanwhile, or the copy failed), they
          are released once the copy no longer reads them, and no hold starts."""
        assert out.kv_blocks is not None
        if self.cache.mirrored:
            staged = asyncio.ensure_future(asyncio.to_thread(self.cache.stage_out, out.kv_blocks))
            try:
                await asyncio.shield(staged)
            except BaseException:
                self._release_once_done(handle, staged)
                raise
        self._held[handle] = asyncio.get_running_loop().call_later(
            self.hold_timeout_s, self._expire, handle
        )
        params = DisaggregatedParams(
            prefill_instance_id=self.runtime.instance_id or 0,
            release_endpoint=self.release_endpoint,
            handle=handle,
            block_ids=out.kv_blocks,
            num_tokens=prompt_len,
            block_size=self.block_size,
            first_token_ids=out.token_ids,
            pool=self.agent.info(),
            cached_tokens=out.usage.cached_tokens if out.usage else 0,
        )
        return EngineOutput(
            request_id=out.request_id,
            token_ids=out.token_ids,
            usage=out.usage,
            logprobs=out.logprobs,
            disaggregated_params=params,
        )

    def _release_once_done(self, handle: str, reading: asyncio.Future[Any]) -> None:
        """Free the engine's blocks of `handle` once `reading` (what reads them) is done."""
        reading.add_done_callback(lambda _: self.engine.release_kv(handle))

    def release(self, handle: str) -> bool:
        timer = self._held.pop(handle, None)
        if timer is None:
            return False
        timer.cancel()
        self.engine.release_kv(handle)
        return True

    def _expire(self, handle: str) -> None:
        if self._held.pop(handle, None) is not None:
            log.warning(
                "KV of %s held %.0fs and not fetched: released", handle, self.hold_timeout_s
            )
            self.engine.release_kv(handle)

    async def kv_release(self, request: Any, context: Context) -> dict[str, bool]:
        """Endpoint: a decode worker read (or gave up on) the blocks of `handle`."""
        if not isinstance(request, dict) or not isinstance(request.get("handle"), str):
            raise ValueError("kv_release takes {'handle': str}")
        return {"released": self.release(request["handle"])}

    # -- decode side ---------------------------------------------------------------------------
    def load(self, load: KvLoad) -> list[int] | None:
        """The engine's loader (on a load thread)."""
        if isinstance(load.source, KvRoom):
            return self.rooms.await_push(load, load.source)
        fetch = load.source
        assert isinstance(fetch, KvFetch)
        params = fetch.params
        assert self._loop is not None
        try:
            src = params.block_ids[load.first_block : load.first_block + len(load.dst_blocks)]
            if len(src) != len(load.dst_blocks):
                raise ValueError("the prefill worker sent fewer blocks than the prompt needs")
            started = time.perf_counter()
            backend = self.agent.read(params.pool, src, load.dst_blocks)
            log.info(
                "request %s: read %d KV blocks (%.2f MB) over %s in %.1f ms",
                load.request_id,
                len(src),
                len(src) * self.agent.pool.block_bytes / 1e6,
                backend,
                (time.perf_counter() - started) * 1e3,
            )
        except BaseException as exc:
            asyncio.run_coroutine_threadsafe(self.release_remote(fetch), self._loop)
            linger_s = self.agent.linger_s(params.pool, "read") if isinstance(exc, OSError) else 0
            if linger_s:  # the read may still land in our blocks: keep them out of use
                raise KvLoadFailed(
                    f"request {load.request_id}: {exc}", writes_end=self._ends_in(linger_s)
                ) from exc
            raise
        # What was read is the prompt's KV only if the prefill worker held the blocks until
        # after the read (its hold may have timed out while the request queued here, and the
        # blocks gone to another request).
        held = asyncio.run_coroutine_threadsafe(self.release_remote(fetch), self._loop)
        try:
            still_held = held.result(CALL_TIMEOUT_S + 1.0)
        except TimeoutError:
            still_held = False
        if not still_held:
            raise KvLoadFailed(
                f"request {load.request_id}: the prefill worker no longer held the KV when the "
                "read ended"
            )
        self.cache.stage_in(load.dst_blocks)
        self._waited(started)
        return None

    def _ends_in(self, seconds: float) -> threading.Event:
        """An event set in `seconds`, after which the engine frees the blocks it kept out."""
        ended = threading.Event()
        assert self._loop is not None

        def end() -> None:
            ended.set()
            self.engine.reclaim_kv_blocks()

        with contextlib.suppress(RuntimeError):  # the loop closed: the engine stops
            self._loop.call_soon_threadsafe(self._loop.call_later, seconds, end)
        return ended

    def _waited(self, since: float) -> None:
        with self._count_lock:
            self.handoffs += 1
            self.handoff_wait_s += time.perf_counter() - since

    async def release_remote(self, fetch: KvFetch) -> bool:
        """Tell the prefill worker to release the blocks of `fetch` (once); whether it held
        them until now (False too if unanswered, or released before)."""
        if fetch.released:
            return False
        fetch.released = True
        return await self.peers.release(fetch.params)

    # -- decode-first, prefill side -------------------------------------------------------------
    def layer_push(self, handle: str, target: KvTarget) -> LayerPush:
        """The writer of a decode-first prompt's KV (the engine's sink for it if `push_layers`:
        else it writes whole blocks at the end)."""
        return LayerPush(handle, target, self.agent, self.cache, self._writers)

    def claim(self, target: KvTarget, pusher: LayerPush) -> RoomClaim:
        """Claim the target's room, in the background: `pusher` writes only once it is
        claimed (and never if the decode worker refuses)."""
        return RoomClaim(self.peers, target, pusher)

    async def stop_push(self, pusher: LayerPush) -> None:
        """`pusher.stop`: returns once none of its writes runs."""
        await self._wait(pusher.stop)

    async def _wait(self, call: Callable[..., None], *args: Any) -> None:
        """`call` (which waits for a push's writes) on a thread for that (any thread once the
        handoff closed: a push that outlived the worker's wait for its end still ends)."""
        try:
            waited = self._waits.submit(call, *args)
        except RuntimeError:  # the pool is shut down
            await asyncio.to_thread(call, *args)
        else:
            await asyncio.wrap_future(waited)

    async def push(
        self,
        handle: str,
        out: EngineOutput,
        target: KvTarget,
        claim: RoomClaim,
        pusher: LayerPush,
    ) -> EngineOutput:
        """Prefill side: write a held request's KV into the target's blocks once `claim`ed
        (what `pusher` did not write as the prompt was computed), free our blocks, report to
        the decode worker; the answer for the PrefillRouter.
        - Our blocks are freed once no write reads them, however the push ends (cancelled
          too, even while it waits for its writes to stop)."""
        ok = False
        if out.kv_blocks is not None:
            try:
                if target.block_size != self.block_size:
                    raise ValueError("the decode worker's blocks do not fit this prompt's")
                if not await claim.accepted():
                    raise ConnectionError("the decode worker no longer waits for this KV")
                started = time.perf_counter()
                await self._wait(pusher.finish, out.kv_blocks)
                self._waited(started)
                ok = True
            except Exception as exc:
                log.warning("request %s: KV write to %s failed: %s", handle, target.room, exc)
            finally:  # no write reads our blocks once freed, even if cancelled meanwhile
                stopped = asyncio.ensure_future(self.stop_push(pusher))
                self._release_once_done(handle, stopped)
                await asyncio.shield(stopped)
        else:  # it stopped at its first token: no KV is wanted
            await self.stop_push(pusher)
        await claim.report(ok, out.token_ids)
        return EngineOutput(
            request_id=out.request_id,
            token_ids=out.token_ids,
            finish_reason=out.finish_reason,
            usage=out.usage,
            logprobs=out.logprobs,
        )
