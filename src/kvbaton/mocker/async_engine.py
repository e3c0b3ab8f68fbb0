"""The mocker's async engine: its steps run on the caller's event loop, not on a thread.

A mocker step computes nothing, so the step thread of `AsyncEngine` bought it only costs: each
step woke the event loop from the other thread and the two traded the GIL, about 30 us of CPU a
step, more than the step itself (issue 32, the mocker's per-step cost). Here the step loop is a
task of the loop that reads the streams.

- A step is scheduled and run at once (its requests then show as running), and its tokens are
  taken in and delivered once its simulated time (`MockerRunner.busy_seconds`) has
  passed: the k-th step of a busy run never before the run's start plus the modeled time of
  its k steps.
- The loop's timers count whole milliseconds, so a wait is rounded up; a wait that ended late
  (that tick, or the loop busy with the streams' outputs, up to LATE_CREDIT_S) is taken off the
  next step's, so a run keeps the model's pace. Steps the model makes shorter than Python runs
  them (speedup 1000) go as fast as it can.
- `stats()` is taken when asked (every caller is on the loop), not after every step: during a
  step's time it shows the step's requests running.
- Everything else is `AsyncEngine`'s: the messages, their order, the streams and their merging,
  KV loads on their threads (which wake the task through the loop).
- Create it on the loop that will read its streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from typing import Protocol

from kvbaton.engine.async_engine import IDLE_POLL_S, AsyncEngine, Message, StreamItem
from kvbaton.engine.engine import EngineStats, LLMEngine

TIMER_TICK_S = 0.001  # the event loop's timer resolution (libuv's: a millisecond)
LATE_CREDIT_S = 0.02  # how late a wait may end (timer tick, the loop's other work) and be repaid


class SimulatedRunner(Protocol):
    busy_seconds: float  # simulated time of all steps so far


class MockerAsyncEngine(AsyncEngine):
    def __init__(self, engine: LLMEngine, runner: SimulatedRunner) -> None:
        self._runner = runner
        self._event_loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        super().__init__(engine)

    def _start(self) -> None:
        self._task = self._event_loop.create_task(self._steps(), name="kvbaton-mocker-steps")

    def _post(self, message: Message | None) -> None:
        super()._post(message)
        if threading.get_ident() == self._loop_thread:
            self._wakeup.set()
        else:  # a KV load's thread
            self._event_loop.call_soon_threadsafe(self._wakeup.set)

    def _deliver_all(self, items: list[tuple[str, StreamItem]]) -> None:
        with self._lock:
            routed = self._routed(items)
        for loop, outputs, item in routed:
            assert loop is self._event_loop, "a mocker's streams are read on the loop it runs on"
            outputs.put_nowait(item)

    def stats(self) -> EngineStats:
        """As of now (every caller is on the loop: no step is halfway through its update)."""
        return self.engine.stats()

    def _renew_stats(self) -> None:
        pass  # taken when asked (`stats`), not after every step

    async def _stepping_stopped(self) -> None:
        if self._task is not None:
            await self._task

    async def _steps(self) -> None:
        try:
            await self._step_loop()
        except Exception as exc:
            self._loop_failed(exc)

    async def _step_loop(self) -> None:
        loop = self._event_loop
        due: float | None = None  # when the steps' simulated time is over; None: idle before
        while True:
            self._wakeup.clear()  # before reading the inbox: a message posted after sets it
            idle, stalled = self._waits()
            applied = self._apply_inbox(block=False)
            if applied is None:
                return
            if (idle or stalled) and not applied:
                due = None
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(IDLE_POLL_S if stalled else None):
                        await self._wakeup.wait()
                        continue  # a message came: read it first
                # Stalled, and no message for IDLE_POLL_S: step again, as the step thread does.
            busy = self._runner.busy_seconds
            run = self._begin_step(applied)
            if run is None:
                continue
            now = loop.time()
            # A wait that ended late (the timer's tick, the loop busy with the streams) is
            # taken off the next one.
            due = (now if due is None else max(due, now - LATE_CREDIT_S)) + (
                self._runner.busy_seconds - busy
            )
            # The step's requests show as running while its time passes, as in a forward pass.
            await asyncio.sleep(_whole_ticks(due - now))  # yields to the loop at least
            self._deliver_all(self._end_step(run))


def _whole_ticks(seconds: float) -> float:
    """`seconds` rounded up to the loop's timer tick (uvloop's timers count whole ms, rounded
    to the nearest): a wait never ends early; 0 for none."""
    if seconds <= 0:
        return 0.0
    return math.ceil(seconds / TIMER_TICK_S) * TIMER_TICK_S
