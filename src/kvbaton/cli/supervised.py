"""A child of `kvbaton serve` ends with it, even when serve gets SIGKILL (which leaves it no
chance to stop its children): Linux's parent-death signal, SIGTERM, so the child drains.

- serve names itself in `SUPERVISOR_PID_ENV`; a child reads it once and removes it, so the
  child's own children (a planner's workers) are not bound to serve.
- A child whose supervisor died before it asked for the signal ends at once.
- Elsewhere than Linux nothing is done."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

SUPERVISOR_PID_ENV = "KVBATON_SUPERVISOR_PID"
PR_SET_PDEATHSIG = 1  # prctl's option (linux/prctl.h)


def end_with_supervisor() -> None:
    """Ask for SIGTERM when the process's parent, serve, dies."""
    supervisor = os.environ.pop(SUPERVISOR_PID_ENV, "")
    if not supervisor.isdigit() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != int(supervisor):  # serve died before the request: end now
        os.kill(os.getpid(), signal.SIGTERM)
