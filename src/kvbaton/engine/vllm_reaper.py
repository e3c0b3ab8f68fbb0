"""Ends vLLM's engine processes when the worker that started them dies, even by SIGKILL.

vLLM 0.32 runs its EngineCore in a child process (and that its model runner in another); a
worker killed with SIGKILL leaves them running, orphaned (checked on the CPU wheel). Before it
starts vLLM, the worker starts this file as a script (`python -I vllm_reaper.py WORKER_PID`)
with a pipe on its stdin. The reaper notes the worker's descendants: every `SCAN_S` while vLLM
starts, once more when the worker writes a line (vLLM is up), then no more. When the pipe
closes (the worker ended, however), it sends SIGTERM to each noted process still alive,
SIGKILL to those alive `GRACE_S` later, removes the directories it was given (vLLM's ipc
endpoints) and the shared memory its processes left (vLLM's ring buffers), and exits.

- Only processes that started after the reaper (a clock tick later at least) are noted:
  what the worker ran before it (anything not vLLM's) is left alone.
- A process is noted with its start time (/proc/PID/stat): a pid the system gave to another
  process since is left alone.
- The reaper ignores SIGINT and SIGTERM (a terminal's Ctrl-C, or a signal to the worker's
  group, must not end it before the worker), and runs in a session of its own.
- Shared memory: the `psm_*` segments of /dev/shm (multiprocessing's names, vLLM's ring
  buffers) a noted process mapped when noted. After the processes end, each such segment that
  no process maps any more is unlinked; vLLM's own unlink runs only in a process that ends
  normally.
- It imports nothing of kvbaton (no torch in a process that only waits).
- Linux only (/proc); elsewhere `Reaper.start` starts nothing.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 5.0
POLL_S = 0.1
SCAN_S = 1.0  # while vLLM starts
SHM = Path("/dev/shm")
SEGMENT_PREFIX = "psm_"  # multiprocessing.shared_memory's names


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None if no process runs under the
    pid (none, or a zombie: dead, not yet reaped by its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command's ")": state is field 3
    return None if fields[0] == "Z" else int(fields[19])  # start time: field 22


def descendants(pid: int) -> list[int]:
    """The process's children, theirs, and so on (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children.get(child, [])
    return found


def mapped_segments(pid: int) -> set[str]:
    """The names of the `psm_*` segments of /dev/shm the process maps and that are not
    unlinked yet; none if it is gone."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    found = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith(f"{SHM}/{SEGMENT_PREFIX}") and not path.endswith(" (deleted)"):
            found.add(path.removeprefix(f"{SHM}/"))
    return found


def unlink_unmapped(segments: set[str]) -> None:
    """Unlink each of the segments no process maps."""
    mapped: set[str] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            mapped |= mapped_segments(int(entry.name))
    for name in segments - mapped:
        (SHM / name).unlink(missing_ok=True)


class Reaper:
    """The worker's handle on its reaper."""

    def __init__(self, proc: subprocess.Popen[bytes] | None) -> None:
        self._proc = proc

    @classmethod
    def start(cls, remove: tuple[Path, ...] = ()) -> Reaper:
        """A reaper of this process's descendants (start it before they start), and of the
        directories `remove`."""
        if not sys.platform.startswith("linux"):
            return cls(None)
        script = str(Path(__file__).resolve())  # -I: without its directory on the path
        proc = subprocess.Popen(
            [sys.executable, "-I", script, str(os.getpid()), *map(str, remove)],
            stdin=subprocess.PIPE,
            start_new_session=True,  # out of the worker's process group and its signals
        )
        return cls(proc)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def started(self) -> None:
        """The processes to reap have all started: note them once more, then stop looking."""
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.write(b"started\n")
                self._proc.stdin.flush()

    def close(self, timeout: float = 30.0) -> None:
        """End whatever of the noted processes is left; wait for the reaper to exit."""
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
            self._proc.wait(timeout)


def _alive(noted: dict[int, int]) -> list[int]:
    return [pid for pid, start in noted.items() if start_time(pid) == start]


def _signal(noted: dict[int, int], sig: signal.Signals) -> None:
    for pid in _alive(noted):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_for_ends(noted: dict[int, int]) -> None:
    deadline = time.monotonic() + GRACE_S
    while _alive(noted) and time.monotonic() < deadline:
        time.sleep(POLL_S)


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    worker, remove = int(argv[0]), argv[1:]
    born = start_time(os.getpid()) or 0
    noted: dict[int, int] = {}
    segments: set[str] = set()

    def note() -> None:
        for pid in descendants(worker):
            start = start_time(pid)
            if pid != os.getpid() and pid not in noted and start is not None and start > born:
                noted[pid] = start
        for pid in _alive(noted):
            segments.update(mapped_segments(pid))

    stdin, scanning = sys.stdin.fileno(), True
    while True:
        readable, _, _ = select.select([stdin], [], [], SCAN_S if scanning else None)
        if not readable:
            note()
            continue
        if not os.read(stdin, 4096):  # the worker's end of the pipe closed
            break
        note()
        scanning = False
    _signal(noted, signal.SIGTERM)
    _wait_for_ends(noted)
    _signal(noted, signal.SIGKILL)
    _wait_for_ends(noted)  # a killed process unmaps its memory as it ends
    for directory in remove:
        shutil.rmtree(directory, ignore_errors=True)
    unlink_unmapped(segments)


if __name__ == "__main__":
    main(sys.argv[1:])
