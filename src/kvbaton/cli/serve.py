"""`kvbaton serve`: a whole deployment on one machine, frontends and workers, each in its own
process, found through file discovery in a private temporary directory (unless `--discovery`
names one).

- It pulls the default model if needed, then supervises the children (supervisor.py): a child
  that exits unasked is started again in its slot, with backoff; one that cannot start stops
  the deployment with its last log lines and exit code 1.
- It binds the HTTP port itself and holds it (not listening) while it runs; every frontend
  (`--frontends N`) listens on it too (`kvbaton frontend --reuse-port`), and the kernel spreads
  connections over those listening; a restarted frontend listens on the same port.
- A worker is ready once discovery lists its process under the namespace; a frontend, once it
  said it serves and the port answers /live.
- It says where to connect once the port serves the model (its /health is 200).
- SIGINT and SIGTERM stop every child gracefully (each drains, `--drain-timeout`); it then
  exits 0, or 1 where a child did not stop cleanly within its drain and `STOP_MARGIN_S` (it
  was killed, or it crashed as it stopped: the log says which).
- Its slots are kept where `kvbaton status` and the frontends' cluster page read them
  (runtime/serve_state.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from functools import partial

from kvbaton.cli.core_share import core_share, vllm_worker_cores
from kvbaton.cli.frontend_flags import (
    API_KEY_ENV,
    FRONTEND_FLAGS,
    busy_thresholds,
    canary_settings,
    migration_settings,
)
from kvbaton.cli.routing import ROUTER_FLAGS, router_settings
from kvbaton.cli.stacks import dump_stacks_then
from kvbaton.cli.status import list_instances
from kvbaton.cli.supervisor import ChildSpec, Supervisor
from kvbaton.cli.worker import WORKER_FLAGS, check_engine_flags
from kvbaton.llm.model_files import KNOWN_MODELS, pull, served_name
from kvbaton.runtime.http_embed import bound
from kvbaton.runtime.serve_state import state_path
from kvbaton.runtime.settings import RuntimeSettings

log = logging.getLogger("kvbaton.serve")

STOP_MARGIN_S = 10.0  # a child's stop beyond its drain: deregistering, the engine's teardown
READY_TIMEOUT_S = 600.0  # a cold model load on a busy machine
REGISTERED_POLL_S = 0.5
_URL = re.compile(r"OpenAI API at (http://\S+)/v1")


def _flags(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def _commands(args: argparse.Namespace, http_port: int) -> list[tuple[str, str, list[str]]]:
    """Each child's slot name, role ("frontend" or the worker's) and command: the frontends
    first (sharing `http_port`)."""
    base = [sys.executable, "-m", "kvbaton"]
    common = ["--namespace", args.namespace, "--log-level", args.log_level]
    frontend = [
        *base,
        "frontend",
        *common,
        "--http-host",
        args.http_host,
        "--http-port",
        str(http_port),
        "--reuse-port",
        *_flags(args, ROUTER_FLAGS),
        *_flags(args, FRONTEND_FLAGS),
        *([] if args.kv_events else ["--no-kv-events"]),
        *(["--enforce-disagg"] if args.enforce_disagg else []),
    ]

    slots = [("worker", "agg", args.workers)] if args.mode == "agg" else [
        ("prefill", "prefill", args.prefill_workers), ("decode", "decode", args.decode_workers)
    ]  # fmt: skip
    roles = [(f"{name}-{i}", role) for name, role, count in slots for i in range(count)]
    cores = None  # vLLM's workers: one slice of the cores each, unless the user bound them
    if args.engine == "vllm" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = vllm_worker_cores(len(roles), list(os.sched_getaffinity(0)))
    passthrough = getattr(args, "vllm_args", [])  # vLLM's engine arguments, after `--`

    def worker(role: str, index: int) -> list[str]:
        flags = ["--role", role, "--engine", args.engine, *common, *_flags(args, WORKER_FLAGS)]
        flags += ["--cpu-cores", cores[index]] if cores else []
        if args.worker_system_ports is not None:
            flags += ["--system-port", str(args.worker_system_ports + index)]
        return [*base, "worker", *flags, *(["--", *passthrough] if passthrough else [])]

    workers = [(name, role, worker(role, i)) for i, (name, role) in enumerate(roles)]
    n = args.frontends
    frontends = [
        ("frontend" if n == 1 else f"frontend-{i}", "frontend", frontend) for i in range(n)
    ]
    return [*frontends, *workers]


SHARED_PORTS_ENV = ("KVBATON_PORT", "KVBATON_SYSTEM_PORT")


def _pull_if_needed(args: argparse.Namespace) -> None:
    if args.model in KNOWN_MODELS:  # once: a pulled model is only looked at
        pull(args.model, progress=lambda line: print(line, file=sys.stderr, flush=True))


def serve(args: argparse.Namespace, settings: RuntimeSettings) -> int:
    if min(args.workers, args.prefill_workers, args.decode_workers, args.frontends) < 1:
        raise ValueError(
            "--frontends, --workers, --prefill-workers and --decode-workers must be at least 1"
        )
    for name in SHARED_PORTS_ENV:  # one port for several processes: all but one would fail
        if os.environ.get(name, "0") != "0":
            raise ValueError(
                f"{name} names one port, but serve starts several processes that each bind "
                "their own: unset it (serve's children pick free ports; "
                "--worker-system-ports gives its workers system ports)"
            )
    router_settings(args)  # bad settings fail here, not in a child
    migration_settings(args)
    busy_thresholds(args)
    canary_settings(args)
    check_engine_flags(args)
    processes = args.workers if args.mode == "agg" else args.prefill_workers + args.decode_workers
    first = args.worker_system_ports
    if first is not None and not 1 <= first <= 65536 - processes:
        raise ValueError(
            f"--worker-system-ports: ports {first} to {first + processes - 1} are not all valid"
        )
    if first is not None and first <= args.http_port < first + processes:
        raise ValueError(f"--worker-system-ports: the HTTP port {args.http_port} is among them")
    _pull_if_needed(args)
    cores = len(os.sched_getaffinity(0))
    args.num_threads = core_share(args.engine, processes, cores, args.num_threads).worker_threads
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
        with _hold_port(args.http_host, args.http_port) as port:
            return _supervise(args, env, private_dir is not None, port)
    finally:
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)


def _hold_port(host: str, port: int) -> socket.socket:
    """The HTTP port (0: a free one), bound for the frontends to share. Bound alone first: a
    port that another process holds, even one that shares it (another serve), is refused."""
    with bound(host, port) as alone:
        port = alone.getsockname()[1]
    return bound(host, port, reuse_port=True)


def _http_url(host: str, port: int) -> str:
    return f"http://{host if ':' not in host else f'[{host}]'}:{port}"


def _supervise(
    args: argparse.Namespace, env: dict[str, str], private: bool, port: socket.socket
) -> int:
    """`private`: the discovery is this deployment's own (named once it is ready). `port`: the
    HTTP port, held, which every frontend listens on."""
    discovery = env["KVBATON_DISCOVERY"]
    host, number = port.getsockname()[:2]
    url = _http_url(host, number)
    registered = _RegisteredPids(discovery, args.namespace)
    specs = []
    for name, role, command in _commands(args, number):
        if role == "frontend":
            frontend = _Frontend(url, command)
            specs.append(ChildSpec(name, frontend.command, frontend.ready, frontend.on_line, role))
        else:
            specs.append(ChildSpec(name, partial(list, command), registered.has, role=role))
    model = args.served_model_name or served_name(args.model)

    def announce() -> bool:
        """The deployment serves once the port serves the model: say where, once."""
        if not _serves(url):
            return False
        print(f"kvbaton serve: model {model} ready at {url}/v1", flush=True)
        if args.worker_system_ports is not None:
            workers = [s.name for s in specs if s.role != "frontend"]
            at, first = env["KVBATON_HOST"], args.worker_system_ports
            metrics = (f"{w} {_http_url(at, first + i)}/metrics" for i, w in enumerate(workers))
            print(f"kvbaton serve: workers' metrics: {', '.join(metrics)}", flush=True)
        if private:
            print(
                f"kvbaton serve: its instances: kvbaton status --discovery {discovery}",
                flush=True,
            )
        return True

    supervisor = Supervisor(
        specs,
        env,
        ready_timeout_s=READY_TIMEOUT_S,
        stop_timeout_s=float(env["KVBATON_DRAIN_TIMEOUT"]) + STOP_MARGIN_S,
        state_file=state_path(os.getpid()),
        state_extra={"discovery": discovery, "namespace": args.namespace},
        announce=announce,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _signum, _frame: supervisor.stop())
    dump_stacks_then(signal.SIGUSR1, lambda _signum, _frame: supervisor.pass_on_stack_dump())
    return supervisor.run()


class _Frontend:
    """A frontend's slot: ready once its child (the one started last) said it listens and the
    port answers."""

    def __init__(self, url: str, command: list[str]) -> None:
        self.url = url
        self._command = command
        self._said = False

    def command(self) -> list[str]:
        self._said = False  # a new child: it has said nothing yet
        return list(self._command)

    def on_line(self, line: str) -> None:
        if _URL.search(line):
            self._said = True

    def ready(self, _pid: int) -> bool:
        return self._said and _answers(f"{self.url}/live")


class _RegisteredPids:
    """Which processes discovery lists under the namespace, asked at most every
    `REGISTERED_POLL_S`."""

    def __init__(self, discovery: str, namespace: str) -> None:
        self._settings = RuntimeSettings(discovery=discovery)
        self._namespace = namespace
        self._pids: set[int] = set()
        self._at = -REGISTERED_POLL_S

    def has(self, pid: int) -> bool:
        if pid not in self._pids and time.monotonic() - self._at >= REGISTERED_POLL_S:
            self._at = time.monotonic()
            try:
                instances = asyncio.run(list_instances(self._settings, self._namespace))
            except Exception as exc:  # discovery unreachable for now: not ready yet
                log.debug("listing instances failed: %s", exc)
                return False
            self._pids = {i.pid for i in instances}
        return pid in self._pids


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _serves(url: str) -> bool:
    """The frontend at `url` serves a model (its /health says 200)."""
    return _answers(f"{url}/health")
