"""Ends vLLM's engine processes when the worker that started them dies, even by SIGKILL.

vLLM 0.32 runs its EngineCore in a child process (and that its model runner in another); a
worker killed with SIGKILL leaves them running, orphaned (checked on the CPU wheel). The worker
starts this file as a script, `python -I vllm_reaper.py PID:START ...`, with a pipe on its
stdin: when the pipe closes (the worker ended, however), the reaper sends SIGTERM to each
process still alive, SIGKILL to those alive `GRACE_S` later, and exits.

- A process is named by its pid and its start time (/proc/PID/stat), so a pid the system gave
  to another process since is left alone.
- The reaper ignores SIGINT and SIGTERM (a terminal's Ctrl-C, or serve stopping its children's
  group, must not end it before the worker).
- Linux only (/proc); elsewhere `start_reaper` starts nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 5.0
POLL_S = 0.1


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if there is no process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command's ")"


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


def start_reaper(pids: list[int]) -> subprocess.Popen[bytes] | None:
    """Start a reaper for `pids` (each named by its start time now); keep the returned process
    (its stdin) open for as long as the processes should live, then close its stdin."""
    if not sys.platform.startswith("linux"):
        return None
    named = [f"{pid}:{start}" for pid in pids if (start := start_time(pid)) is not None]
    # This file alone (-I: without its directory on the path), not `-m`: the engine package
    # would import torch into a process that only waits.
    return subprocess.Popen(
        [sys.executable, "-I", str(Path(__file__).resolve()), *named],
        stdin=subprocess.PIPE,
        start_new_session=True,  # out of the worker's process group and its signals
    )


def _alive(named: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(pid, start) for pid, start in named if start_time(pid) == start]


def _signal(named: list[tuple[int, int]], sig: signal.Signals) -> None:
    for pid, _ in _alive(named):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    named = [(int(p), int(s)) for p, s in (arg.split(":") for arg in argv)]
    while sys.stdin.buffer.read(4096):  # until the worker's end of the pipe closes
        pass
    _signal(named, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while _alive(named) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    _signal(named, signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1:])
