"""The engine's async face for workers: the step loop runs on a thread of its own (a step is
blocking tensor work), requests and aborts go in through a queue, outputs come back to each
caller's event loop.

A request's life: `add_request` validates at once (ValueError to the caller), then queues it;
the loop thread admits it before its next step; outputs stream to the caller's async iterator
until one carries a finish reason. Leaving the iterator early, or `abort(request_id)`, aborts
the request, which frees its blocks before the next step.

The KV connector (`connector.py`): a held request's stream ends with the output that names its
blocks (`kv_blocks`); `release_kv` frees them, or, if the stream is left before that output is
read, the abort it sends does. A request's `kv_source` loads on a thread of its own at once (a
pool of `max_num_seqs` threads: a decode-first load waits until the prefill worker wrote the
KV, which starts only once its blocks were announced); a load that failed makes the request
compute its prompt here (after the tokens of a `KvLoadFailed`; in other blocks while its
`writes_end` is not set, which `reclaim_kv_blocks` then frees once it is).

Invariants:
- a held request's blocks are freed once: by the first of `release_kv` and its abort.
- a stream left before it read its last output aborts its request, held or not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path

from kvbaton.engine.config import EngineConfig
from kvbaton.engine.connector import (
    EmitEvent,
    EngineRequest,
    KvCacheView,
    KvLoad,
    KvLoadFailed,
    KvTier,
)
from kvbaton.engine.engine import EngineStats, LLMEngine, StepRun
from kvbaton.protocols.kv import KvDump, KvEvent
from kvbaton.protocols.llm import EngineOutput

log = logging.getLogger(__name__)


@dataclass
class _Loaded:
    request_id: str
    ok: bool
    token_ids: list[int] | None
    writes_end: threading.Event | None = None


@dataclass
class _Release:
    request_id: str


@dataclass
class _Reclaim:
    pass


@dataclass
class _Call:
    """Run `fn` on the step thread between steps; its result resolves `future`."""

    fn: Callable[[], object]
    future: concurrent.futures.Future[object]


@dataclass
class _Wake:
    """Nothing to apply: the loop renews the stats it reports (a background load ended)."""


@dataclass
class _Abort:
    request_id: str
    outputs: object = None  # the stream that asked; None: whatever runs under the id


# The step loop's messages, and what a request's stream is handed: the seams a subclass with
# a step loop of its own (the mocker's) overrides `_post` and `_deliver_all` with.
Message = EngineRequest | _Abort | _Call | _Loaded | _Release | _Reclaim | _Wake
StreamItem = EngineOutput | BaseException
_Outputs = asyncio.Queue[StreamItem]  # a request's stream, read on its caller's loop
SHUT_DOWN = "the engine is shut down"
IDLE_POLL_S = 0.5  # a step that ran nothing waits this long for a message, at most


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._loads: concurrent.futures.ThreadPoolExecutor | None = None
        self._inbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Outputs]] = {}
        self._lock = threading.Lock()
        self._stats = engine.stats()  # a snapshot, replaced by the step thread
        engine.on_kv_loads = self._start_loads
        self._stopped: str | None = None  # why requests are refused: shut down, or broken
        self._failed: concurrent.futures.Future[str] = concurrent.futures.Future()  # why broken
        runner = engine.model_runner
        if runner is not None and runner.compiling is not None:  # the stats change at its end
            runner.compiling.future.add_done_callback(lambda _: self._post(_Wake()))
        self._start()

    def _start(self) -> None:
        """Start stepping (here: the step thread)."""
        self._thread = threading.Thread(target=self._loop, name="kvbaton-engine", daemon=True)
        self._thread.start()

    def _post(self, message: Message | None) -> None:
        """Hand a message to the step loop (None: stop), from any thread."""
        self._inbox.put(message)

    @classmethod
    async def create(
        cls,
        config: EngineConfig,
        on_kv_event: Callable[[KvEvent], None] | None = None,
        cache_buffer: Callable[[int], memoryview] | None = None,
        kv_tier: Callable[[KvCacheView, EmitEvent], KvTier] | None = None,
    ) -> AsyncEngine:
        """Load the model off the event loop, then start the step thread.

        - The model loads on a thread of its own that has ended before the step thread starts:
          each thread that runs torch's parallel regions keeps a GNU OpenMP pool, and with two
          pools there are more OpenMP threads than cores, so libgomp stops spinning between
          regions. On 2 cores, serve then decoded at about half the offline engine's speed
          (bench/serve_vs_offline.py; docs/benchmarks-log.md).
        """
        loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvbaton-load")
        try:
            load = loader.submit(
                LLMEngine, config, on_kv_event, None, cache_buffer, kv_tier=kv_tier
            )
            engine = await asyncio.wrap_future(load)
        finally:
            await asyncio.to_thread(loader.shutdown)  # its thread, and its OpenMP pool, end
        return cls(engine)

    async def add_request(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Outputs of one request, the last with a finish reason (or, held, its blocks). Raises
        ValueError at once for a request that could never run; closing the iterator early
        aborts the request."""
        request_id = request.request_id
        self.engine.check_request(request.prompt_token_ids, request.params)
        guided = self.engine.guided
        if request.params.guided is not None and guided is not None:  # off the step loop
            await asyncio.to_thread(guided.compile, request.params.guided)
        outputs: _Outputs = asyncio.Queue()
        with self._lock:  # shutdown takes it too: a request is either failed by it or refused
            if self._stopped is not None:
                raise RuntimeError(self._stopped)
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = (asyncio.get_running_loop(), outputs)
            self._post(request)
        return self._stream(request_id, outputs)

    async def _stream(
        self, request_id: str, outputs: _Outputs
    ) -> AsyncGenerator[EngineOutput, None]:
        finished = False
        held: EngineOutput | BaseException | None = None  # taken, not merged: the next item
        try:
            while True:
                item = held if held is not None else await outputs.get()
                held = None
                while isinstance(item, EngineOutput) and not outputs.empty():
                    later = outputs.get_nowait()  # came while the reader was busy: one output
                    merged = item.merged(later) if isinstance(later, EngineOutput) else None
                    if merged is None:
                        held = later
                        break
                    item = merged
                if isinstance(item, BaseException):
                    raise item
                finished = item.is_last
                yield item
                if finished:
                    return
        finally:
            if not finished:  # only this stream's request, not a later one with its id
                self._post(_Abort(request_id, outputs))

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step (a held one's too: call it
        only if nobody reads them). Idempotent."""
        self._post(_Abort(request_id))

    def release_kv(self, request_id: str) -> None:
        """Free a held request's blocks (before the next step). Idempotent."""
        self._post(_Release(request_id))

    def reclaim_kv_blocks(self) -> None:
        """Free, before the next step, the blocks of failed loads whose `writes_end` is set."""
        self._post(_Reclaim())

    def stats(self) -> EngineStats:
        """As of the end of the last step (or of the last requests admitted or aborted)."""
        return self._stats

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    @property
    def model_dir(self) -> Path:
        return self.engine.model_dir

    async def clear_kv_blocks(self) -> int:
        """Drop every cached block no request holds (between two steps); how many went."""
        cleared = await self._between_steps(self.engine.clear_kv_blocks)
        assert isinstance(cleared, int)
        return cleared

    async def kv_dump(self) -> KvDump:
        """Every cached block, as of the last KV event sent (taken between two steps)."""
        dump = await self._between_steps(self.engine.kv_dump)
        assert isinstance(dump, KvDump)
        return dump

    async def _between_steps(self, fn: Callable[[], object]) -> object:
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        with self._lock:
            if self._stopped is not None:
                raise RuntimeError(self._stopped)
            self._post(_Call(fn, future))
        return await asyncio.wrap_future(future)

    async def wait_failed(self) -> str:
        """Return why, once the step loop broke (never while the engine serves, nor after a
        shutdown). Cancelling the wait leaves the engine as it is."""
        return await asyncio.shield(asyncio.wrap_future(self._failed))

    async def shutdown(self) -> None:
        with self._lock:
            self._stopped = SHUT_DOWN
            self._post(None)
        await self._stepping_stopped()
        if self._loads is not None:
            self._loads.shutdown(wait=False, cancel_futures=True)
        if self.engine.model_runner is not None:
            await asyncio.to_thread(self.engine.model_runner.close)
        if self.engine.tier is not None:
            await asyncio.to_thread(self.engine.tier.close)

    async def _stepping_stopped(self) -> None:
        """Once the step loop has stopped (after the None message)."""
        await asyncio.to_thread(self._thread.join, 30)

    # -- the step thread ---------------------------------------------------------------------
    def _deliver(self, request_id: str, item: StreamItem) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, StreamItem]]) -> None:
        """Hand each item to its request's stream: one wake-up of each caller's loop for all
        of a step's outputs (a wake-up per output cost as much as the step, under load)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Outputs, StreamItem]]] = {}
        with self._lock:
            for loop, outputs, item in self._routed(items):
                by_loop.setdefault(loop, []).append((outputs, item))
        for loop, puts in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody listens
                loop.call_soon_threadsafe(_put_all, puts)

    def _routed(
        self, items: list[tuple[str, StreamItem]]
    ) -> list[tuple[asyncio.AbstractEventLoop, _Outputs, StreamItem]]:
        """Each item with its stream and the stream's loop (hold the lock): items of streams
        that ended are dropped; a stream's last item (or error) ends it."""
        routed = []
        for request_id, item in items:
            entry = self._streams.get(request_id)
            if entry is None:
                continue
            if isinstance(item, BaseException) or item.is_last:
                del self._streams[request_id]
            routed.append((*entry, item))
        return routed

    def _apply(self, message: Message) -> None:
        if isinstance(message, _Loaded):
            final = self.engine.finish_kv_load(
                message.request_id, message.ok, message.token_ids, message.writes_end
            )
            if final is not None:
                self._deliver(message.request_id, final)
            return
        if isinstance(message, _Release):
            self.engine.release_kv(message.request_id)
            return
        if isinstance(message, _Reclaim):
            self.engine.reclaim_kv_blocks()
            return
        if isinstance(message, _Wake):
            return
        if isinstance(message, _Call):
            if message.future.set_running_or_notify_cancel():  # else the caller gave up
                try:
                    message.future.set_result(message.fn())
                except Exception as exc:
                    message.future.set_exception(exc)
            return
        if isinstance(message, _Abort):
            if message.outputs is not None:
                with self._lock:
                    entry = self._streams.get(message.request_id)
                if entry is not None and entry[1] is not message.outputs:
                    return  # that stream ended; the id now names another request
            final = self.engine.abort_request(message.request_id)
            if final is not None:
                self._deliver(message.request_id, final)
            return
        try:
            self.engine.add_request(message)
        except ValueError as exc:  # checked before queueing; the engine's state may differ
            self._deliver(message.request_id, exc)

    def _start_loads(self, loads: list[KvLoad]) -> None:
        for load in loads:
            if self._loads is None:
                self._loads = concurrent.futures.ThreadPoolExecutor(
                    self.engine.config.max_num_seqs, thread_name_prefix="kvbaton-kv-load"
                )
            future = self._loads.submit(load.source.load, load)
            future.add_done_callback(functools.partial(self._loaded, load.request_id))

    def _loaded(self, request_id: str, future: concurrent.futures.Future[list[int]]) -> None:
        if future.cancelled():
            self._post(_Loaded(request_id, False, None))
            return
        error = future.exception()
        if error is None:
            self._post(_Loaded(request_id, True, future.result()))
            return
        failed = error if isinstance(error, KvLoadFailed) else KvLoadFailed(str(error))
        if not failed.token_ids:
            log.warning("request %s: KV load failed (%s); prefilling here", request_id, error)
        self._post(_Loaded(request_id, False, failed.token_ids, failed.writes_end))

    def _loop(self) -> None:
        try:
            while True:
                idle, stalled = self._waits()
                applied = self._apply_inbox(
                    block=idle or stalled, timeout=IDLE_POLL_S if stalled else None
                )
                if applied is None:
                    return
                self._deliver_all(self._run_step(applied))
        except Exception as exc:
            self._loop_failed(exc)

    def _loop_failed(self, exc: Exception) -> None:
        """The step loop broke outside a step (a step's own failure fails only its requests).

        - The engine is stopped: later requests and calls are refused, as after shutdown.
        - Every open stream and every call waiting in the inbox gets the error, so nobody
          waits on a loop that is gone; `wait_failed` returns it.
        - Unlike `_fail_all`, nothing is aborted in the engine: its state may be what broke,
          and an abort that raised here would leave the streams waiting.
        """
        log.exception("engine step loop failed; the engine is stopped")
        error = RuntimeError(f"the engine's step loop failed: {exc!r}")
        with self._lock:
            self._stopped = str(error)
            ids = list(self._streams)
        self._deliver_all([(request_id, error) for request_id in ids])
        self._failed.set_result(str(error))
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Call) and message.future.set_running_or_notify_cancel():
                message.future.set_exception(error)

    def _waits(self) -> tuple[bool, bool]:
        """(idle: nothing to step, stalled: nothing ran in the last step)."""
        idle = not self.engine.has_unfinished()
        # Requests wait for blocks that loads or holds keep: only a message can change that.
        return idle, not idle and self.engine.last_step_tokens == 0

    def _apply_inbox(self, block: bool, timeout: float | None = None) -> bool | None:
        """Apply the waiting messages (with `block`, waiting up to `timeout` for the first);
        whether any was. None at the stop message: every open stream got SHUT_DOWN, and the
        step loop ends."""
        applied = False
        try:
            while True:
                message = self._inbox.get(block=block and not applied, timeout=timeout)
                if message is None:
                    self._fail_all(RuntimeError(SHUT_DOWN))
                    return None
                self._apply(message)
                applied = True
        except queue.Empty:
            return applied

    def _run_step(self, applied: bool) -> list[tuple[str, StreamItem]]:
        """One engine step if it has work; its outputs, to deliver."""
        run = self._begin_step(applied)
        return [] if run is None else self._end_step(run)

    def _begin_step(self, applied: bool) -> StepRun | None:
        """A step scheduled and run, if the engine has work. The stats snapshot is renewed
        before it if messages were `applied` (a long step may follow: the load report should
        show what came in). A step that fails fails its requests, not the process."""
        if not self.engine.has_unfinished():
            self._renew_stats()
            return None
        if applied:
            self._renew_stats()
        try:
            return self.engine.begin_step()
        except Exception as exc:
            log.exception("engine step failed")
            self._fail_all(exc)
            self._renew_stats()
            return None
        finally:
            self._start_loads(self.engine.take_kv_loads())  # a step that failed early

    def _end_step(self, run: StepRun) -> list[tuple[str, StreamItem]]:
        """A run step's tokens taken in; its outputs, to deliver. The stats snapshot is renewed."""
        try:
            outputs = self.engine.end_step(run)
        except Exception as exc:
            log.exception("engine step failed")
            self._fail_all(exc)
            return []
        finally:
            self._renew_stats()
        return [(out.request_id, out) for out in outputs]

    def _renew_stats(self) -> None:
        """Take a snapshot of the engine's stats (on the step thread: they read its queues)."""
        self._stats = self.engine.stats()

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            self.engine.abort_request(request_id)
        self._deliver_all([(request_id, exc) for request_id in ids])


def _put_all(puts: list[tuple[_Outputs, StreamItem]]) -> None:
    for outputs, item in puts:
        outputs.put_nowait(item)
