"""`kill -USR1 PID`: a kvbaton process writes every thread's stack to its log and goes on (a
hung process, seen without stopping it).

- Written by faulthandler's C-level signal handler, not by Python code: a process whose main
  thread is stuck writes too.
- Only once the process has started: before, SIGUSR1's default action ends it (serve passes it
  on to ready children only).
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
from collections.abc import Callable
from types import FrameType


def dump_stacks_on(signum: int, chain: bool = False) -> None:
    """On `signum`, write every thread's stack to stderr (where stderr is a file: not where a
    caller replaced it, as a test's capture does). `chain`: then run the handler set before."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        faulthandler.register(signum, file=sys.stderr.fileno(), all_threads=True, chain=chain)


def dump_stacks_then(signum: int, handler: Callable[[int, FrameType | None], object]) -> None:
    """On `signum`, write every thread's stack to stderr, then run `handler` (a Python signal
    handler). (faulthandler keeps a signal it registered as its own: it is let go first.)"""
    faulthandler.unregister(signum)
    signal.signal(signum, handler)
    dump_stacks_on(signum, chain=True)
