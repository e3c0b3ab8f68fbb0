"""The local connector: `kvbaton worker` processes on this machine, one pool per role.

A worker's life here:
1. started: `python -m kvbaton worker *worker_args[role]` (the args carry --role, --engine,
   --model, --discovery, --namespace, ...), its output appended to `log_dir/{role}-{n}.log`;
   it counts in `current()` from then on (it registers in discovery once it has started).
2. asked to stop (scale down takes the newest first): SIGTERM. A kvbaton worker then
   deregisters at once and drains its in-flight streams (the runtime's shutdown, up to its
   `drain_timeout`), so no request is lost. It no longer counts in `current()`.
3. reaped in the background: SIGKILL if it has not exited `stop_grace_s` after the SIGTERM.

A worker that exits on its own stops counting as well (its exit code is logged); the planner's
next decision replaces it. Only processes this connector started are ever signalled, by PID,
and only while they have not been reaped. `close()` stops every one of them and waits.

Core slots (`core_slots`, for vLLM workers on a CPU, which otherwise all bind to the same cores):
- each worker started gets one slot as `--cpu-cores`, before any `--` (vLLM's own arguments);
- the slot is the first one no live worker holds (a stopping worker holds its slot until it
  exits); with every slot held, the one the fewest live workers hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from kvbaton.planner.connectors import ROLES, check_replicas

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0  # above a worker's default drain_timeout (10 s)
KILL_WAIT_S = 10.0  # after SIGKILL, for the kernel to let it go
EXITS_KEPT = 256  # exit codes of the workers that exited last


@dataclass(eq=False)
class _Worker:
    role: str
    seq: int
    proc: asyncio.subprocess.Process
    log_path: Path
    cores: str | None = None  # its core slot, where the connector has slots
    stopping: bool = False
    reaper: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def signal(self, sig: signal.Signals) -> None:
        """Signal the process we started, unless it has already exited (been reaped)."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)


class LocalConnector:
    def __init__(
        self,
        worker_args: Mapping[str, Sequence[str]],
        env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        stop_grace_s: float = STOP_GRACE_S,
        python: str = sys.executable,
        core_slots: Sequence[str] = (),
    ) -> None:
        """`worker_args[role]`: the `kvbaton worker` arguments of that role's workers; `env`:
        their environment (default: this process's); `log_dir`: where their logs go (default:
        a new temporary directory, named in the log when the first worker starts);
        `core_slots`: CPU lists given out as `--cpu-cores` (see the module's docstring)."""
        if stop_grace_s <= 0:
            raise ValueError("stop_grace_s must be positive")
        self.core_slots = list(core_slots)
        self.worker_args = {role: list(args) for role, args in worker_args.items()}
        self.env = dict(env) if env is not None else None
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self.stop_grace_s = stop_grace_s
        self.python = python
        self._workers: dict[str, list[_Worker]] = {role: [] for role in self.worker_args}
        self._seq = 0
        self._exits: dict[int, int] = {}  # pid -> exit code, of the workers that exited
        self._lock = asyncio.Lock()
        self._closed = False

    # -- what the planner sees

    async def current(self) -> dict[str, int]:
        counts = {role: 0 for role in ROLES}
        for role in self.worker_args:
            counts[role] = len(self._serving(role))
        return counts

    async def scale(self, role: str, replicas: int) -> None:
        if not check_replicas(role, replicas, self.worker_args):
            return
        async with self._lock:
            if self._closed:
                raise RuntimeError("the local connector is closed")
            serving = self._serving(role)
            if len(serving) < replicas:
                log.info("local: scaling %s from %d to %d", role, len(serving), replicas)
                for _ in range(replicas - len(serving)):
                    await self._start(role)
            elif len(serving) > replicas:
                log.info("local: scaling %s from %d to %d", role, len(serving), replicas)
                for worker in reversed(serving[replicas:]):  # the newest first
                    self._stop(worker)

    async def close(self) -> None:
        """Stop every worker this connector started (SIGTERM; SIGKILL after `stop_grace_s`) and
        wait for all of them. Idempotent."""
        async with self._lock:
            self._closed = True
            for workers in self._workers.values():
                for worker in workers:
                    if not worker.stopping:
                        self._stop(worker)
            reapers = [w.reaper for ws in self._workers.values() for w in ws if w.reaper]
        await asyncio.gather(*reapers, return_exceptions=True)

    # -- for tests and status

    def pids(self, role: str) -> list[int]:
        """The PIDs of `role`'s workers that count in `current()`, oldest first."""
        return [w.proc.pid for w in self._serving(role)] if role in self._workers else []

    def stopping_pids(self) -> list[int]:
        """The PIDs of workers asked to stop that have not exited yet."""
        return [w.proc.pid for ws in self._workers.values() for w in ws if w.stopping and w.alive]

    def exit_code(self, pid: int) -> int | None:
        """How the worker of `pid`, one this connector started, ended (a negative code: the
        signal that killed it; 0 once it stopped on its own after a SIGTERM); None while it runs,
        for a pid it never started, or for all but the last `EXITS_KEPT` to exit."""
        for worker in (w for ws in self._workers.values() for w in ws if w.proc.pid == pid):
            return worker.proc.returncode  # (exited, not yet forgotten: its code already)
        return self._exits.get(pid)

    @property
    def log_dir(self) -> Path | None:
        return self._log_dir

    # -- inside

    def _serving(self, role: str) -> list[_Worker]:
        """`role`'s workers that count (started, not asked to stop, not exited), oldest first;
        forgets the ones that exited on their own."""
        workers = self._workers.get(role, [])
        for worker in [w for w in workers if not w.stopping and not w.alive]:
            log.warning(
                "local: %s worker pid %d exited on its own (code %s; log %s)",
                role,
                worker.proc.pid,
                worker.proc.returncode,
                worker.log_path,
            )
            self._forget(worker)
        return [w for w in workers if not w.stopping]

    def _forget(self, worker: _Worker) -> None:
        """A worker that exited is no longer ours (nothing signals it); its exit code is kept."""
        if worker.proc.returncode is not None:
            self._exits.pop(worker.proc.pid, None)  # (a reused pid's: the newest again)
            self._exits[worker.proc.pid] = worker.proc.returncode
            if len(self._exits) > EXITS_KEPT:
                del self._exits[next(iter(self._exits))]  # the oldest
            with contextlib.suppress(ValueError):
                self._workers[worker.role].remove(worker)

    async def _start(self, role: str) -> None:
        self._seq += 1
        log_path = self._log_path(role, self._seq)
        args = self.worker_args[role]
        cores = self._free_slot()
        if cores is not None:
            end = args.index("--") if "--" in args else len(args)
            args = [*args[:end], "--cpu-cores", cores, *args[end:]]
        cmd = [self.python, "-m", "kvbaton", "worker", *args]
        with _open_log(log_path) as out:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        self._workers[role].append(_Worker(role, self._seq, proc, log_path, cores))
        on = "" if cores is None else f" on cores {cores}"
        log.info("local: started %s worker pid %d%s (log %s)", role, proc.pid, on, log_path)

    def _free_slot(self) -> str | None:
        """The core slot for the next worker (None without slots): the first that no live
        worker holds, else the one the fewest hold."""
        if not self.core_slots:
            return None
        held = [w.cores for ws in self._workers.values() for w in ws if w.alive]
        return min(self.core_slots, key=held.count)

    def _stop(self, worker: _Worker) -> None:
        worker.stopping = True
        log.info("local: stopping %s worker pid %d (it drains first)", worker.role, worker.proc.pid)
        worker.signal(signal.SIGTERM)
        worker.reaper = asyncio.create_task(
            self._reap(worker), name=f"kvbaton-local-reap-{worker.proc.pid}"
        )

    async def _reap(self, worker: _Worker) -> None:
        pid = worker.proc.pid
        try:
            try:
                async with asyncio.timeout(self.stop_grace_s):
                    code = await worker.proc.wait()
            except TimeoutError:
                log.warning(
                    "local: %s worker pid %d still running %.0fs after SIGTERM; killing it",
                    worker.role,
                    pid,
                    self.stop_grace_s,
                )
                worker.signal(signal.SIGKILL)
                try:
                    async with asyncio.timeout(KILL_WAIT_S):
                        code = await worker.proc.wait()
                except TimeoutError:
                    log.error("local: worker pid %d did not die after SIGKILL", pid)
                    return
            log.info("local: %s worker pid %d stopped (code %d)", worker.role, pid, code)
        finally:
            self._forget(worker)

    def _log_path(self, role: str, seq: int) -> Path:
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="kvbaton-workers-"))
            log.info("local: worker logs in %s", self._log_dir)
        return self._log_dir / f"{role}-{seq}.log"


def _open_log(path: Path) -> BinaryIO:
    """The worker's log file, opened for appending (the child keeps its own descriptor)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "ab")  # closed by the caller's `with`
