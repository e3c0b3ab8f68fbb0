"""A supervisor of child processes: `kvbaton serve`'s frontend and workers, one slot each.

A slot's life (`SlotState`, with every transition in `_TRANSITIONS`), from NEW:
1. STARTING: its child runs, not yet ready (its `ready` probe says when it is).
2. READY: the child serves.
3. BACKOFF: the child exited unasked; a new one starts in the same slot (same command) after
   the backoff delay: 1 s, doubling to 30 s, back to 1 s once a child had served 60 s.
4. STOPPING, then STOPPED: the deployment stops (a signal, or a slot that cannot start).

Invariants:
- A child that became ready and later exits is always started again.
- A slot whose first child exits before it is ready, or whose children fail `max_failed_starts`
  starts in a row without becoming ready (or stay unready `ready_timeout_s`), stops the
  deployment: `run` returns 1 after logging the slot, its exit and its child's last log lines.
  So does a deployment not announced (`announce`) within `ready_timeout_s` of its start.
- SIGINT or SIGTERM stops every child with SIGTERM (each drains), kills one still alive after
  `stop_timeout_s`; `run` then returns 0, or 1 where a child that ran did not end cleanly (it
  was killed, or it crashed or exited with an error as it stopped), which the log names.
- Only the supervisor's own children are ever signalled, by PID.
- A child ends (SIGTERM) when the supervisor dies, even by SIGKILL (`supervised.py`).
- The slots' states, PIDs, restarts and last exits are written to `state_file` (JSON, replaced
  atomically) at each change, for `kvbaton status`; the file is removed when `run` returns.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvbaton.cli.supervised import SUPERVISOR_PID_ENV

log = logging.getLogger("kvbaton.serve")

TAIL_LINES = 20  # a child's last log lines, shown when its slot stops the deployment
TICK_S = 0.1


class SlotState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    STOPPED = "stopped"


_TRANSITIONS: dict[SlotState, set[SlotState]] = {
    SlotState.NEW: {SlotState.STARTING, SlotState.STOPPING},
    SlotState.STARTING: {SlotState.READY, SlotState.BACKOFF, SlotState.STOPPING},
    SlotState.READY: {SlotState.BACKOFF, SlotState.STOPPING},
    SlotState.BACKOFF: {SlotState.STARTING, SlotState.STOPPING},
    SlotState.STOPPING: {SlotState.STOPPED},
    SlotState.STOPPED: set(),
}


@dataclass(frozen=True)
class Backoff:
    """Seconds before a crashed child starts again: `first`, doubling up to `most`; back to
    `first` once a child had been ready for `reset_after_s`."""

    first: float = 1.0
    most: float = 30.0
    reset_after_s: float = 60.0

    def next(self, last: float, served_s: float | None) -> float:
        """The wait before the next start, after a wait of `last` (0: none yet) and a child
        that served `served_s` (None: it never became ready)."""
        if not last or (served_s is not None and served_s >= self.reset_after_s):
            return self.first
        return min(last * 2, self.most)


@dataclass(frozen=True)
class ChildSpec:
    """`command()`: the child's command line, asked at each start (a restart may differ: the
    frontend keeps the port its first child bound); `ready(pid)`: the child serves;
    `on_line(line)`: each line it logs; `role`: what the child is, in the state file
    ("frontend", or a worker's role)."""

    name: str
    command: Callable[[], list[str]]
    ready: Callable[[int], bool]
    on_line: Callable[[str], None] = lambda line: None
    role: str = ""


class DeploymentFailed(Exception):
    """A slot cannot start its child: the deployment stops."""


@dataclass
class Slot:
    spec: ChildSpec
    state: SlotState = SlotState.NEW
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    failed_starts: int = 0  # in a row, without becoming ready
    ever_ready: bool = False
    child_ready: bool = False  # its child of now was ready once (it takes SIGUSR1)
    wait: float = 0.0  # the last backoff: seconds before its child's start (0: none yet)
    since: float = 0.0  # monotonic time of the last transition
    last_exit: str = ""
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    reader: threading.Thread | None = None  # what copies the child's output

    def move(self, new: SlotState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise AssertionError(f"slot {self.spec.name}: {self.state.value} -> {new.value}")
        self.state = new
        self.since = time.monotonic()

    def report(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "role": self.spec.role,
            "state": self.state.value,
            "pid": self.process.pid if self.process else None,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
        }


def _stopped_cleanly(slot: Slot) -> bool:
    """Whether the slot's child ended as a stop asks: code 0, or SIGTERM's default end (a child
    still starting); else its end is logged (killed, crashed, an error exit)."""
    assert slot.process is not None and slot.process.returncode is not None
    code = slot.process.returncode
    if code in (0, -signal.SIGTERM):
        return True
    slot.last_exit = describe_exit(code)
    log.error(
        "%s (pid %d) ended (%s) as it stopped", slot.spec.name, slot.process.pid, slot.last_exit
    )
    return False


def describe_exit(code: int) -> str:
    """A Popen return code in words: `code 3` or `signal SIGKILL`."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


class Supervisor:
    def __init__(
        self,
        specs: list[ChildSpec],
        env: dict[str, str],
        *,
        backoff: Backoff | None = None,
        ready_timeout_s: float = 600.0,
        stop_timeout_s: float = 15.0,
        max_failed_starts: int = 5,
        state_file: Path | None = None,
        state_extra: dict[str, Any] | None = None,
        announce: Callable[[], bool] = lambda: True,
    ) -> None:
        """`announce()`: asked at each tick while every slot is ready, until it answers True
        (it says the deployment serves, once); `state_extra`: written into the state file beside
        the slots."""
        self.slots = [Slot(spec) for spec in specs]
        self.env = env | {SUPERVISOR_PID_ENV: str(os.getpid())}  # children end with us
        self.backoff = backoff or Backoff()
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.max_failed_starts = max_failed_starts
        self.state_file = state_file
        self.state_extra = state_extra or {}
        self.announce = announce
        self.failure = ""  # why the deployment stopped, if a slot could not start
        self._stop_asked = False  # a plain flag: see `stop`
        self._dump_asked = False  # `pass_on_stack_dump`
        self._written: list[dict[str, Any]] = []

    def stop(self) -> None:
        """Stop the deployment (from a signal handler or another thread).

        - Takes no lock: a signal handler runs between any two lines of the main thread, even
          where that thread holds a lock (a `threading.Event`'s, in its `wait`), and would wait
          on it forever.
        """
        self._stop_asked = True

    def pass_on_stack_dump(self) -> None:
        """Have each child that was ready write its stacks (`kill -USR1`; a child still starting
        would end). From a signal handler: a flag, as `stop`, that the thread that reaps the
        children acts on (none is signalled once reaped), also while it stops them."""
        self._dump_asked = True

    def _pass_on_stack_dump(self) -> None:
        self._dump_asked = False
        for slot in self.slots:
            process = slot.process
            if slot.child_ready and process is not None and process.poll() is None:
                process.send_signal(signal.SIGUSR1)

    def run(self) -> int:
        """Supervise until stopped (0; 1 where a child did not end cleanly) or a slot cannot
        start its child (1)."""
        code = 0
        try:
            for slot in self.slots:
                self._start(slot)
            announced = False
            started = time.monotonic()
            while not self._stop_asked_after(TICK_S):
                for slot in self.slots:
                    self._tick(slot)
                if self._dump_asked:
                    self._pass_on_stack_dump()
                if not announced and all(s.state is SlotState.READY for s in self.slots):
                    announced = self.announce()
                if not announced and time.monotonic() - started > self.ready_timeout_s:
                    raise DeploymentFailed(f"not serving after {self.ready_timeout_s:g} s")
                self._write_state()
        except DeploymentFailed as exc:
            self.failure = str(exc)
            log.error("%s\nstopping the deployment", exc)
            code = 1
        finally:
            if not self._stop_all():
                code = 1
            if self.state_file is not None:
                self.state_file.unlink(missing_ok=True)
        return code

    def _stop_asked_after(self, seconds: float) -> bool:
        """Whether a stop was asked, after `seconds` (a signal's handler runs within them)."""
        time.sleep(seconds)
        return self._stop_asked

    # -- a slot's transitions ----------------------------------------------------------------
    def _start(self, slot: Slot) -> None:
        command = slot.spec.command()
        slot.tail.clear()
        slot.process = subprocess.Popen(
            command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        slot.child_ready = False
        slot.move(SlotState.STARTING)
        slot.reader = threading.Thread(
            target=self._pump, args=(slot, slot.process.stdout), daemon=True
        )
        slot.reader.start()

    def _tick(self, slot: Slot) -> None:
        now = time.monotonic()
        process = slot.process
        if slot.state is SlotState.BACKOFF:
            if now - slot.since >= slot.wait:
                slot.restarts += 1
                log.warning("%s: starting again (restart %d)", slot.spec.name, slot.restarts)
                self._start(slot)
            return
        assert process is not None
        code = process.poll()
        if code is not None:
            self._exited(slot, describe_exit(code))
        elif slot.state is SlotState.STARTING:
            if slot.spec.ready(process.pid):
                slot.move(SlotState.READY)
                slot.ever_ready = slot.child_ready = True
                slot.failed_starts = 0
                log.info("%s: ready (pid %d)", slot.spec.name, process.pid)
            elif now - slot.since > self.ready_timeout_s:
                process.kill()
                process.wait()
                self._exited(slot, f"not ready after {self.ready_timeout_s:g} s; killed")

    def _exited(self, slot: Slot, how: str) -> None:
        """The slot's child exited unasked: into BACKOFF, or DeploymentFailed."""
        if self._stop_asked:
            return  # a Ctrl-C reaches the children too: they may exit before the loop ends
        assert slot.process is not None
        pid = slot.process.pid
        slot.last_exit = how
        served_s = time.monotonic() - slot.since if slot.state is SlotState.READY else None
        if served_s is None:
            slot.failed_starts += 1
            if not slot.ever_ready or slot.failed_starts >= self.max_failed_starts:
                if slot.reader is not None:
                    slot.reader.join(5)  # its output, read to the end
                tail = "\n".join(f"  [{slot.spec.name}] {line}" for line in slot.tail)
                tries = (
                    f"{slot.failed_starts} starts in a row"
                    if slot.ever_ready
                    else "its first start"
                )
                raise DeploymentFailed(
                    f"{slot.spec.name} (pid {pid}) failed {tries} before it was ready ({how}); "
                    f"its last log lines:\n{tail}"
                )
        slot.wait = self.backoff.next(slot.wait, served_s)
        log.error(
            "%s (pid %d) exited (%s); starting it again in %g s",
            slot.spec.name,
            pid,
            how,
            slot.wait,
        )
        slot.move(SlotState.BACKOFF)

    def _stop_all(self) -> bool:
        """Stop every child; whether each that ran stopped cleanly (`_stopped_cleanly`): those
        alive, and after a stop asked, those that ended since the loop last looked."""
        running = (SlotState.STARTING, SlotState.READY)
        judged = [
            s
            for s in self.slots
            if s.process is not None
            and (s.process.poll() is None or (self._stop_asked and s.state in running))
        ]
        live = [s for s in judged if s.process is not None and s.process.poll() is None]
        for slot in self.slots:
            if slot.state is not SlotState.STOPPED:
                slot.move(SlotState.STOPPING)
        for slot in live:
            assert slot.process is not None
            slot.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for slot in live:
            assert slot.process is not None
            try:
                while slot.process.poll() is None:  # (a stack dump asked meanwhile is passed on)
                    if self._dump_asked:
                        self._pass_on_stack_dump()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise subprocess.TimeoutExpired(slot.spec.name, self.stop_timeout_s)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        slot.process.wait(min(TICK_S, left))
            except subprocess.TimeoutExpired:
                log.error(
                    "%s (pid %d) did not stop in %g s; killing it",
                    slot.spec.name,
                    slot.process.pid,
                    self.stop_timeout_s,
                )
                slot.process.kill()
                slot.process.wait()
        for slot in self.slots:
            if slot.state is SlotState.STOPPING:
                slot.move(SlotState.STOPPED)
        return all([_stopped_cleanly(slot) for slot in judged])

    # -- output and state --------------------------------------------------------------------
    def _pump(self, slot: Slot, stream: IO[bytes]) -> None:
        """Copy a child's output to ours, each line prefixed with its slot's name."""
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            slot.tail.append(line)
            slot.spec.on_line(line)
            sys.stderr.write(f"[{slot.spec.name}] {line}\n")
            sys.stderr.flush()

    def _write_state(self) -> None:
        if self.state_file is None:
            return
        slots = [s.report() for s in self.slots]
        if slots == self._written:
            return
        self._written = slots
        body = {**self.state_extra, "pid": os.getpid(), "slots": slots}
        tmp = self.state_file.with_name(f".{self.state_file.name}.tmp")
        tmp.write_text(json.dumps(body, indent=1))
        tmp.replace(self.state_file)
