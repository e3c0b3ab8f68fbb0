"""Shared fixtures: a temp discovery directory and echo worker processes that are always
stopped (by PID) at the end of the test."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import clean_env
from tests.servers import EtcdServer, KubeStandIn, NatsServer, running

# The suite's engines run eagerly, as `clean_env` makes them in processes it starts (a compiled
# decode's package takes minutes to build; the tests of compiled decoding ask for one).
os.environ["KVBATON_COMPILE"] = "none"

WorkerFactory = Callable[..., subprocess.Popen[bytes]]
_SERVING = re.compile(r"serving \S+ as instance ([0-9a-f]+) ")


def worker_log(tmp_path: Path, index: int) -> Path:
    """The log of the `index`-th worker `spawn_worker` started in the test (from 0)."""
    return tmp_path / f"worker-{index}.log"


def instance_id(log: Path) -> int:
    """The instance id a worker's log says it serves as (once it serves)."""
    found = _SERVING.search(log.read_text(errors="replace"))
    if found is None:
        raise AssertionError(f"{log.name} names no instance yet")
    return int(found.group(1), 16)


# The suite's longest test (vLLM's own tests, in their environment): about a third of the suite's
# time on one process.
LONGEST = Path(__file__).parent / "test_vllm_environment.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The suite's order, for pyproject's `-n 2 --dist loadfile`: the longest test first, then
    files without slow tests, then files with them.
    - One process runs the longest test while the other takes the quick files beside it; the
      slow files (real models, load, faults) come once it is over, beside each other.
    - A file's tests keep their order (module-scoped deployments rely on it); so do files of
      one rank."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: 0 if item.path == LONGEST else 2 if item.path in slow else 1)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Under `-n 2`, a test marked `alone` (one that judges how fast a deployment answers under
    load) has the machine to itself.
    - It waits for the other process's test to end, and that process waits for it; every
      other test shares the machine (shared flocks in the run's base directory).
    - A waiting `alone` test holds the gate: no new test starts before it (no starving).
    - The wait is outside the test's timeout (this hook wraps pytest-timeout's)."""
    if not hasattr(item.config, "workerinput"):  # not an xdist worker (a test's own pytest)
        yield
        return
    root = Path(item.config.getoption("basetemp")).parent  # xdist gives each process its own
    alone = item.get_closest_marker("alone") is not None
    with open(root / "machine.gate", "a") as gate, open(root / "machine.lock", "a") as machine:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        yield


@pytest.fixture(scope="session", autouse=True)
def children_keep_their_bytecode() -> Iterator[None]:
    """The processes the tests start write the bytecode of what they compile, as Python does
    by default, and so reuse it.
    - An environment may say not to (PYTHONDONTWRITEBYTECODE): then every process compiled
      kvbaton's sources again (an editable install has no bytecode), a few tenths of a second
      each, in each of the suite's hundreds of processes.
    - The bytecode goes to `__pycache__` beside the sources, which git ignores.
    - This process is unchanged (Python read the setting at its start)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
        yield


@pytest.fixture
def discovery_url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'discovery'}"


@pytest.fixture
def spawn_worker(tmp_path: Path, discovery_url: str) -> Iterator[WorkerFactory]:
    """Start `kvbaton worker` processes (echo by default) on the test's discovery directory."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(
        *extra: str, lease_ttl: float = 2.0, namespace: str = "t", engine: str = "echo"
    ) -> subprocess.Popen[bytes]:
        log = open(worker_log(tmp_path, len(procs)), "wb")  # noqa: SIM115 (closed below)
        env = clean_env()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvbaton",
                "worker",
                "--engine",
                engine,
                "--discovery",
                discovery_url,
                "--lease-ttl",
                str(lease_ttl),
                "--namespace",
                namespace,
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the session (tests use their own key prefixes through namespaces)."""
    with running(EtcdServer(tmp_path_factory.mktemp("etcd"))) as server:
        yield server


@pytest.fixture(scope="session")
def kube_standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStandIn]:
    """One Kubernetes API stand-in for the session (tests use namespaces of their own)."""
    with running(KubeStandIn(tmp_path_factory.mktemp("kube"))) as server:
        yield server


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with running(NatsServer(tmp_path_factory.mktemp("nats"))) as server:
        yield server
