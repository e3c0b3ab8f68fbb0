"""Waiting for posted NIXL transfers: one thread per NIXL agent checks every transfer in flight
(`check_xfer_state`, which also progresses it), at most `MAX_POLL_S` apart, and wakes each
waiter once its transfer ended. A thread per transfer, each polling, would wake up to 2,000
times a second per transfer: 128,000 wake-ups a second with 64 transfers in flight.

Invariants: a transfer's handle is touched by the poller only while its waiter waits (a waiter
that stops waiting, however, takes it out of the poller's list first, so its handle may then be
released); the poller's thread holds the poller only weakly, and not at all while it idles, so
a poller let go without `close` is collected and its thread ends."""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

MAX_POLL_S = 0.0005  # the longest sleep between two looks at a transfer in flight
IDLE_WAKE_S = 0.5  # an idle poller looks whether it was let go this often


@dataclass(eq=False)
class _InFlight:
    """A posted transfer the poller checks until it ends (`done`: `state`, or `error`)."""

    handle: Any
    done: threading.Event = field(default_factory=threading.Event)
    state: str = "PROC"
    error: Exception | None = None


class TransferPoller:
    def __init__(self, agent: Any, name: str) -> None:
        """`agent`: the NIXL agent whose transfers are waited for."""
        self._agent = agent
        self._in_flight: list[_InFlight] = []  # checked by the poller holding `_changed`
        self._changed = threading.Condition()
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=_poll_loop,
            args=(weakref.ref(self), self._closed, self._changed, self._in_flight),
            name=f"nixl-poller-{name}",
            daemon=True,
        )
        self._thread.start()

    def wait(self, handle: Any, deadline: float) -> str:
        """Until the posted transfer `handle` ended: its last state ("DONE", or an error's);
        TimeoutError at the monotonic `deadline`; what NIXL raised when checking it."""
        waiting = _InFlight(handle)
        with self._changed:
            if self._closed.is_set():
                raise RuntimeError("the NIXL poller is closed")
            self._in_flight.append(waiting)
            self._changed.notify()
        try:
            waiting.done.wait(max(0.0, deadline - time.monotonic()))
        finally:  # out of the list, the poller no longer touches its handle
            with self._changed:
                if waiting in self._in_flight:
                    self._in_flight.remove(waiting)
        if not waiting.done.is_set():
            raise TimeoutError
        error, waiting.error = waiting.error, None
        if error is not None:
            try:
                raise error
            finally:  # (its traceback holds this frame: no cycle through it)
                del error
        return waiting.state

    def close(self) -> None:
        """End the thread; a transfer still waited for (none should be) fails at once."""
        self._closed.set()
        with self._changed:
            for waiting in self._in_flight:
                waiting.error = RuntimeError("the NIXL poller closed")
                waiting.done.set()
            self._in_flight.clear()
            self._changed.notify()
        self._thread.join(timeout=5.0)

    def _poll(self) -> None:
        """(On the thread, holding `_changed`.) Check each transfer in flight once."""
        for waiting in list(self._in_flight):
            try:
                state = str(self._agent.check_xfer_state(waiting.handle))
            except Exception as exc:  # (its traceback would tie this frame, and the poller)
                waiting.error, state = exc.with_traceback(None), "ERR"
            if state != "PROC":
                waiting.state = state
                self._in_flight.remove(waiting)
                waiting.done.set()


def _poll_loop(
    poller_ref: weakref.ref[TransferPoller],
    closed: threading.Event,
    changed: threading.Condition,
    in_flight: list[_InFlight],
) -> None:
    """Check the transfers in flight until the poller is closed or collected, sleeping between
    two rounds from 0 up to `MAX_POLL_S` (back to 0 once none is in flight)."""
    pause = 0.0
    while not closed.is_set():
        poller = poller_ref()
        if poller is None:
            return
        with changed:
            idle = not in_flight
            if not idle:
                poller._poll()
        del poller
        if idle:
            pause = 0.0
            with changed:
                if not in_flight and not closed.is_set():
                    changed.wait(IDLE_WAKE_S)  # a transfer posted, or the close
            continue
        time.sleep(pause)
        pause = min(max(2 * pause, 1e-5), MAX_POLL_S)
