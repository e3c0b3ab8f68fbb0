"""`kvbaton serve`: a whole deployment on one machine, a frontend and N workers, each in its own
process, found through file discovery in a private temporary directory (unless `--discovery`
names one).

The supervisor pulls the default model if needed, starts the components, streams their logs
with a prefix, prints where to connect once the frontend serves the model, forwards SIGINT and
SIGTERM, and stops them all when one exits."""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import IO

from kvbaton.cli.frontend_flags import (
    API_KEY_ENV,
    FRONTEND_FLAGS,
    busy_thresholds,
    canary_settings,
    migration_settings,
)
from kvbaton.cli.routing import ROUTER_FLAGS, router_settings
from kvbaton.cli.worker import WORKER_FLAGS, check_engine_flags
from kvbaton.llm.model_files import KNOWN_MODELS, pull, served_name
from kvbaton.runtime.settings import RuntimeSettings

log = logging.getLogger("kvbaton.serve")

STOP_TIMEOUT_S = 15.0
READY_TIMEOUT_S = 600.0  # a cold model load on a busy machine
_URL = re.compile(r"OpenAI API at (http://\S+)/v1")


def _flags(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def _commands(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    base = [sys.executable, "-m", "kvbaton"]
    common = ["--namespace", args.namespace, "--log-level", args.log_level]
    frontend = [
        *base,
        "frontend",
        *common,
        "--http-host",
        args.http_host,
        "--http-port",
        str(args.http_port),
        *_flags(args, ROUTER_FLAGS),
        *_flags(args, FRONTEND_FLAGS),
        *([] if args.kv_events else ["--no-kv-events"]),
        *(["--enforce-disagg"] if args.enforce_disagg else []),
    ]

    def worker(role: str) -> list[str]:
        flags = ["--role", role, "--engine", args.engine, *common, *_flags(args, WORKER_FLAGS)]
        return [*base, "worker", *flags]

    if args.mode == "agg":
        workers = [(f"worker-{i}", worker("agg")) for i in range(args.workers)]
    else:
        workers = [(f"prefill-{i}", worker("prefill")) for i in range(args.prefill_workers)]
        workers += [(f"decode-{i}", worker("decode")) for i in range(args.decode_workers)]
    return [("frontend", frontend), *workers]


def _pump(name: str, stream: IO[bytes], found_url: list[str]) -> None:
    """Copy a child's output to ours, each line prefixed with the child's name."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        if not found_url and (m := _URL.search(line)):
            found_url.append(m.group(1))
        sys.stderr.write(f"[{name}] {line}\n")
        sys.stderr.flush()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _pull_if_needed(args: argparse.Namespace) -> None:
    if args.model in KNOWN_MODELS:  # once: a pulled model is only looked at
        pull(args.model, progress=lambda line: print(line, file=sys.stderr, flush=True))


def serve(args: argparse.Namespace, settings: RuntimeSettings) -> int:
    if min(args.workers, args.prefill_workers, args.decode_workers) < 1:
        raise ValueError("--workers, --prefill-workers and --decode-workers must be at least 1")
    router_settings(args)  # bad settings fail here, not in a child
    migration_settings(args)
    busy_thresholds(args)
    canary_settings(args)
    check_engine_flags(args)
    _pull_if_needed(args)
    processes = args.workers if args.mode == "agg" else args.prefill_workers + args.decode_workers
    if args.num_threads is None and args.engine == "torch" and processes > 1:
        args.num_threads = max(1, (os.cpu_count() or 1) // processes)
    private_dir = None
    discovery = settings.discovery
    if not (args.discovery or os.environ.get("KVBATON_DISCOVERY")):
        private_dir = tempfile.mkdtemp(prefix="kvbaton-serve-")
        discovery = f"file://{private_dir}"
    env = dict(os.environ)
    env.update(
        {
            "KVBATON_DISCOVERY": discovery,
            "KVBATON_REQUEST_PLANE": settings.request_plane,
            "KVBATON_EVENT_PLANE": settings.event_plane,
            "KVBATON_NATS_URL": settings.nats_url,
            "KVBATON_HOST": settings.host,
            "KVBATON_LEASE_TTL": str(settings.lease_ttl),
            "KVBATON_DRAIN_TIMEOUT": str(settings.drain_timeout),
        }
    )
    if args.api_key:
        env[API_KEY_ENV] = args.api_key
    try:
        return _supervise(args, env, private_dir is not None)
    finally:
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)


def _supervise(args: argparse.Namespace, env: dict[str, str], private: bool) -> int:
    """`private`: the discovery is this deployment's own (named once it is ready)."""
    found_url: list[str] = []
    children: list[subprocess.Popen[bytes]] = []
    for name, cmd in _commands(args):
        child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        children.append(child)
        threading.Thread(target=_pump, args=(name, child.stdout, found_url), daemon=True).start()
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    model = args.served_model_name or served_name(args.model)
    started = time.monotonic()
    ready = False
    code = 0
    while all(c.poll() is None for c in children) and not stopping:
        if not ready and found_url and _ready(found_url[0]):
            ready = True
            print(f"kvbaton serve: model {model} ready at {found_url[0]}/v1", flush=True)
            if private:
                discovery = env["KVBATON_DISCOVERY"]
                print(
                    f"kvbaton serve: its instances: kvbaton status --discovery {discovery}",
                    flush=True,
                )
        if not ready and time.monotonic() - started > READY_TIMEOUT_S:
            log.error("not ready after %.0fs; stopping", READY_TIMEOUT_S)
            code = 1
            stop(signal.SIGTERM, None)
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
