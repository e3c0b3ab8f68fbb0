"""The prefill worker's side of disaggregation (docs/architecture.md): a request runs to its
first token, then its KV is held for the decode worker to read (prefill-first), or written
into the decode worker's blocks (decode-first, `push.py`).

- Held blocks are released exactly once: by `kv_release`, or after `hold_timeout_s`. A request
  that ends while its blocks are staged out holds nothing: they are freed once the copy ended.
- A pushed request's blocks are freed once no write reads them, however it ends.
- It reports (`kv_ready`) on every decode-first request its engine took, once no write runs or
  starts, before it lets go of the claim (one its engine refused never claims: the router
  abandons it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec

from kvbaton.disagg.push import LayerPush, RoomClaim
from kvbaton.disagg.side import Side
from kvbaton.engine.config import EngineConfig
from kvbaton.engine.connector import EngineRequest, outputs_of
from kvbaton.protocols.disagg import KvRelease, KvReleased
from kvbaton.protocols.llm import DisaggregatedParams, EngineOutput, KvTarget
from kvbaton.runtime import Context
from kvbaton.runtime.request_plane import Handler

log = logging.getLogger(__name__)

DEFAULT_HOLD_TIMEOUT_S = 30.0
PUSH_MODES = ("layers", "blocks")


class PrefillSide(Side):
    def __init__(
        self,
        *args: Any,
        hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S,
        push: str = "layers",
        max_pushes: int = EngineConfig.max_num_seqs,
        **kwargs: Any,
    ) -> None:
        """`push`: how decode-first KV is written ("layers": as the engine computes each;
        "blocks": whole blocks once the prompt is computed); `max_pushes`: the engine's
        max_num_seqs. Each push gets a writer thread and a thread to wait for its writes in,
        so that a write stalled on one decode worker holds up no other."""
        super().__init__(*args, **kwargs)
        if hold_timeout_s <= 0:
            raise ValueError("the KV hold timeout must be positive")
        if push not in PUSH_MODES:
            raise ValueError(f"the KV push must be one of {', '.join(PUSH_MODES)}")
        self.hold_timeout_s = hold_timeout_s
        self.push_layers = push == "layers"
        self._held: dict[str, asyncio.TimerHandle] = {}
        self._writers = concurrent.futures.ThreadPoolExecutor(max_pushes, "kvbaton-kv-push")
        self._waits = concurrent.futures.ThreadPoolExecutor(max_pushes, "kvbaton-kv-push-wait")

    def endpoints(self) -> dict[str, tuple[Handler, type]]:
        return {"kv_release": (self.kv_release, KvRelease)}

    async def close(self) -> None:
        for timer in self._held.values():
            timer.cancel()
        self._held.clear()
        await asyncio.to_thread(self._writers.shutdown)
        await asyncio.to_thread(self._waits.shutdown)
        await super().close()

    def outputs(
        self, request: EngineRequest, target: KvTarget | None
    ) -> AsyncGenerator[EngineOutput, None]:
        """The request's answer: its first token, with where its KV waits (or, with a
        `target`, once written there)."""
        request.hold_kv = True
        return self._holding(request) if target is None else self._pushed(request, target)

    # -- prefill-first --------------------------------------------------------------------------
    async def _holding(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        async with contextlib.aclosing(outputs_of(self.engine, request)) as outputs:
            async for out in outputs:
                yield await self._hold(out, len(request.prompt_token_ids))

    async def _hold(self, out: EngineOutput, prompt_len: int) -> EngineOutput:
        """A held request's answer: its first token and where its KV waits."""
        if out.kv_blocks is None:  # it stopped at its first token
            return out
        handle = out.request_id
        if self.cache.mirrored:
            staged = asyncio.ensure_future(asyncio.to_thread(self.cache.stage_out, out.kv_blocks))
            try:
                await asyncio.shield(staged)
            except BaseException:  # free the blocks once the copy ended
                staged.add_done_callback(lambda _: self.engine.release_kv(handle))
                raise
        self._held[handle] = self.loop.call_later(self.hold_timeout_s, self._expire, handle)
        params = DisaggregatedParams(
            prefill_instance_id=self.runtime.instance_id or 0,
            prefill_component=self.component,
            handle=handle,
            block_ids=out.kv_blocks,
            num_tokens=prompt_len,
            block_size=self.block_size,
            first_token_ids=out.token_ids,
            pool=self.agent.info(),
            cached_tokens=out.usage.cached_tokens if out.usage else 0,
        )
        return msgspec.structs.replace(out, kv_blocks=None, disaggregated_params=params)

    def release(self, handle: str) -> bool:
        """Free held blocks; False if none are held under `handle`."""
        timer = self._held.pop(handle, None)
        if timer is not None:
            timer.cancel()
            self.engine.release_kv(handle)
        return timer is not None

    def _expire(self, handle: str) -> None:
        if self.release(handle):
            log.warning("KV of %s held %.0fs, not fetched: released", handle, self.hold_timeout_s)

    async def kv_release(self, request: KvRelease, context: Context) -> KvReleased:
        """Endpoint: a decode worker read (or gave up on) the blocks of `handle`."""
        return KvReleased(released=self.release(request.handle))

    # -- decode-first ---------------------------------------------------------------------------
    async def _pushed(
        self, request: EngineRequest, target: KvTarget
    ) -> AsyncGenerator[EngineOutput, None]:
        pusher = LayerPush(request.request_id, target, self.agent, self.cache, self._writers)
        request.kv_sink = pusher if self.push_layers else None
        claim: RoomClaim | None = None
        outputs: AsyncGenerator[EngineOutput, None] | None = None
        try:
            outputs = await self.engine.add_request(request)
            claim = RoomClaim(self.peers, target, pusher)
            async for out in outputs:
                yield await self._push(request.request_id, out, claim, pusher)
        finally:
            await self.shielded(self._end_push(outputs, pusher, claim))

    async def _end_push(
        self,
        outputs: AsyncGenerator[EngineOutput, None] | None,
        pusher: LayerPush,
        claim: RoomClaim | None,
    ) -> None:
        """However the request ended: no more writes, then the engine's request aborted (if
        unfinished), then the decode worker told."""
        if claim is not None:
            claim.cancel()  # (answered, unless the request ended first)
        await self._wait(pusher.stop)  # before the abort frees the blocks it reads
        if outputs is not None:
            await outputs.aclose()
        if claim is not None:
            await claim.report(False, [])  # (unless reported)

    async def _wait(self, call: Callable[..., None], *args: Any) -> None:
        """`call` (which waits for a push's writes) on a thread for that (any thread once the
        side closed: a push that outlived the worker's wait for its end still ends)."""
        try:
            waited = self._waits.submit(call, *args)
        except RuntimeError:  # the pool is shut down
            await asyncio.to_thread(call, *args)
        else:
            await asyncio.wrap_future(waited)

    async def _push(
        self, handle: str, out: EngineOutput, claim: RoomClaim, pusher: LayerPush
    ) -> EngineOutput:
        """Write a held request's KV into the target's blocks once claimed, free ours, report;
        the answer for the PrefillRouter.
        - Our blocks are freed once no write reads them, however the push ends."""
        ok = False
        if out.kv_blocks is not None:
            try:
                if pusher.target.block_size != self.block_size:
                    raise ValueError("the decode worker's blocks do not fit this prompt's")
                if not await claim.accepted():
                    raise ConnectionError("the decode worker no longer waits for this KV")
                started = time.perf_counter()
                await self._wait(pusher.finish, out.kv_blocks)
                self.count_handoff(started)
                ok = True
            except Exception as exc:
                log.warning("request %s: KV push failed: %s", handle, exc)
            finally:  # no write reads our blocks once freed, even if cancelled meanwhile
                stopped = asyncio.ensure_future(self._wait(pusher.stop))
                stopped.add_done_callback(lambda _: self.engine.release_kv(handle))
                await asyncio.shield(stopped)
        else:  # it stopped at its first token: no KV is wanted
            await self._wait(pusher.stop)
        await claim.report(ok, out.token_ids)
        return msgspec.structs.replace(out, kv_blocks=None)
