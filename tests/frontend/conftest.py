"""A real `kvbaton serve` (frontend and worker processes) on a tiny random model with a
byte-level tokenizer, started once per module and always stopped by PID."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import DistributedRuntime
from kvbaton.runtime.serve_state import read_states
from tests.helpers import clean_env
from tests.tiny_models import build_chat_model

# The workers' torch device: the CPU unless KVBATON_TEST_DEVICE names another ("cuda").
TEST_DEVICE = os.environ.get("KVBATON_TEST_DEVICE", "cpu")
READY_S = 120.0  # two cold Python starts and a model load on a loaded 2-core machine
NUM_KV_BLOCKS = 64
_READY = re.compile(r"ready at (http://\S+)/v1")
_LISTENING = re.compile(r"OpenAI API at (http://\S+)/v1")
_OWN_DISCOVERY = re.compile(r"its instances: kvbaton status --discovery (\S+)")  # no --discovery


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")


@dataclass
class Deployment:
    proc: subprocess.Popen[bytes]
    url: str  # http://host:port (no /v1)
    discovery: str
    model: str
    lines: list[str] = field(default_factory=list)  # everything the components logged
    reader: threading.Thread | None = None  # what fills `lines` from the process's output

    def log_text(self) -> str:
        """What was logged so far; once the process has exited, all of it (its output read to
        the end)."""
        if self.reader is not None and self.proc.poll() is not None:
            self.reader.join(10)
        return "\n".join(self.lines)


def start_serve(model_dir: Path, discovery_dir: Path | None, *extra: str) -> Deployment:
    """`kvbaton serve` on free ports; returns once it says it is ready. `discovery_dir` None:
    serve's own (the deployment's `discovery` is then what it says it is)."""
    command = [
        "serve",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        str(NUM_KV_BLOCKS),
        *(["--device", TEST_DEVICE] if TEST_DEVICE != "cpu" else []),
        *extra,
    ]
    return _start(command, _READY, discovery_dir, model_dir.name)


def start_frontend(discovery: Path | str, namespace: str, *extra: str) -> Deployment:
    """`kvbaton frontend` alone on a free port; returns once it listens. `discovery`: a
    directory (file discovery) or a discovery URL."""
    command = ["frontend", "--namespace", namespace, *extra]
    return _start(command, _LISTENING, discovery, "")


def _start(
    command: list[str],
    ready_line: re.Pattern[str],
    discovery: Path | str | None,
    model: str,
    ready_s: float = READY_S,
    env: dict[str, str] | None = None,
) -> Deployment:
    """`env`: variables set for the deployment beside the clean environment."""
    url = f"file://{discovery}" if isinstance(discovery, Path) else discovery or ""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvbaton",
            *command,
            "--http-port",
            "0",
            *(["--discovery", url] if url else []),
        ],
        env=clean_env() | {"KVBATON_LEASE_TTL": "3"} | (env or {}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deployment = Deployment(proc, "", url, model)
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            deployment.lines.append(line)
            if not deployment.url and (m := ready_line.search(line)):
                deployment.url = m.group(1)
            if not deployment.discovery and (m := _OWN_DISCOVERY.search(line)):
                deployment.discovery = m.group(1)
            if deployment.url and deployment.discovery:
                ready.set()

    deployment.reader = threading.Thread(target=read, daemon=True)
    deployment.reader.start()
    deadline = time.monotonic() + ready_s
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_serve(proc)
            raise RuntimeError(f"kvbaton {command[0]} did not start:\n" + deployment.log_text())
    return deployment


def serve_slot(deployment: Deployment, slot: str) -> dict[str, Any]:
    """A slot of the deployment's `kvbaton serve` as its state file has it now: name, state,
    pid, restarts, last_exit."""
    (state,) = read_states(deployment.discovery)
    (found,) = [s for s in state["slots"] if s["name"] == slot]
    return dict(found)


def kvbaton_status(discovery: str) -> str:
    """What `kvbaton status --discovery DISCOVERY` prints."""
    return subprocess.run(
        [sys.executable, "-m", "kvbaton", "status", "--discovery", discovery],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        check=True,
    ).stdout


def live_instances(url: str, model: str) -> list[int]:
    """The instance ids the frontend at `url` lists as live for `model` (its /health)."""
    models = httpx.get(f"{url}/health").json()["models"]
    return [int(i, 16) for i in models.get(model, [])]


def wait_for_health(url: str, model: str, instances: int) -> None:
    """Until the frontend at `url` lists `instances` live instances of `model`."""
    deadline = time.monotonic() + READY_S
    while True:
        live = live_instances(url, model)
        if len(live) == instances:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{model} never had {instances} instances: {live}")
        time.sleep(0.1)


async def worker_load(runtime: DistributedRuntime, endpoint: str) -> WorkerLoad:
    """The load of one worker of `endpoint` ("namespace.component.load_metrics")."""
    client = await runtime.endpoint(endpoint).client(response_type=WorkerLoad)
    try:
        await client.wait_for_instances(READY_S)
        loads: list[WorkerLoad] = [x async for x in client.round_robin(None)]
        return loads[0]
    finally:
        await client.close()


async def load_of(discovery: str, worker: int) -> WorkerLoad:
    """The load report of one backend worker of a deployment (by instance id)."""
    async with DistributedRuntime(discovery) as runtime:
        client = await runtime.endpoint("kvbaton.backend.load_metrics").client(
            response_type=WorkerLoad
        )
        try:
            return await anext(client.direct(None, worker, timeout=10))  # type: ignore[no-any-return]
        finally:
            await client.close()


def stop_serve(proc: subprocess.Popen[bytes]) -> int:
    """SIGINT, then SIGKILL 30 s later; before the kill, SIGUSR1 has every thread's stack
    written to the log (a deployment's: every ready child's too)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)  # (the stacks are written at once; a child's pass through serve)
            proc.kill()
    return proc.wait()


def stop_cleanly(deployment: Deployment) -> None:
    """Stops the deployment as `stop_serve` does.

    - Fails unless it exited 0 (for serve: every child stopped cleanly), with its last 80 log
      lines in the message.
    """
    code = stop_serve(deployment.proc)
    shown = 400 if code == -signal.SIGKILL else 80  # killed: the stacks it wrote too
    tail = "\n".join(deployment.log_text().splitlines()[-shown:])
    assert code == 0, f"kvbaton exited {code}; its last lines:\n{tail}"


@contextlib.contextmanager
def served_beside_a_plain_frontend(
    model_dir: Path, discovery: Path, *flags: str
) -> Iterator[tuple[Deployment, Deployment]]:
    """`kvbaton serve` with `flags`, and a `kvbaton frontend` without them on the same
    discovery, once it sees the model; both stopped cleanly at the end."""
    served = start_serve(model_dir, discovery, *flags)
    try:
        plain = start_frontend(discovery, "kvbaton")
        try:
            wait_for_health(plain.url, served.model, 1)
            yield served, plain
        finally:
            stop_cleanly(plain)
    finally:
        stop_cleanly(served)


@pytest.fixture(scope="module")
def long_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A tiny model of 1,024 positions: its template's tool prompt is longer than 256."""
    model = build_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat", max_positions=1024)
    deployment = start_serve(model, tmp_path_factory.mktemp("discovery"))
    yield deployment
    stop_cleanly(deployment)


@pytest.fixture(scope="module")
def served(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = start_serve(chat_model, tmp_path_factory.mktemp("discovery"))
    yield deployment
    stop_serve(deployment.proc)
