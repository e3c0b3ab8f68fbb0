"""`kvbaton serve`: a whole deployment on one machine, each component in its own process.

The supervisor starts the components, forwards SIGINT/SIGTERM to them, and stops them all when
one exits. Until the LLM engine and frontend land, the deployment is one or more echo workers.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time

from kvbaton.runtime.settings import RuntimeSettings

log = logging.getLogger("kvbaton.serve")

STOP_TIMEOUT_S = 15.0


def _component_commands(args: argparse.Namespace) -> list[list[str]]:
    base = [sys.executable, "-m", "kvbaton"]
    return [
        [
            *base,
            "worker",
            "--engine",
            "echo",
            "--namespace",
            args.namespace,
            "--log-level",
            args.log_level,
        ]
        for _ in range(args.workers)
    ]


def serve(args: argparse.Namespace, settings: RuntimeSettings) -> int:
    env = dict(os.environ)
    env.update(
        {
            "KVBATON_DISCOVERY": settings.discovery,
            "KVBATON_REQUEST_PLANE": settings.request_plane,
            "KVBATON_HOST": settings.host,
            "KVBATON_LEASE_TTL": str(settings.lease_ttl),
        }
    )
    children = [subprocess.Popen(cmd, env=env) for cmd in _component_commands(args)]
    log.info(
        "kvbaton serving with %d worker(s); discovery %s; `kvbaton status` lists them",
        len(children),
        settings.discovery,
    )
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code = 0
    while all(c.poll() is None for c in children) and not stopping:
        time.sleep(0.2)
    if not stopping:
        code = next(c.returncode for c in children if c.returncode is not None) or 1
        log.error("a component exited (code %s); stopping the others", code)
        stop(signal.SIGTERM, None)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for child in children:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("component %d did not stop in %.0fs; killing it", child.pid, STOP_TIMEOUT_S)
            child.kill()
            child.wait()
    return code
