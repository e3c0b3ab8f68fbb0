"""`kvbaton serve --frontends N` (issue 32): N frontend processes listen on one port, the kernel
spreads connections over them, and each is supervised: one killed leaves the others serving
every new connection while its slot starts it again on the same port. A port another process
holds is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvbaton.runtime.http_embed import bound
from tests.frontend.conftest import serve_slot, start_serve, stop_cleanly
from tests.helpers import clean_env, wait_until

pytestmark = pytest.mark.integration

MOCKER = ("--engine", "mocker", "--speedup-ratio", "10", "--frontends", "2")
CLIENTS = 16  # connections; all on one of two replicas: a chance of 2 in 65,536
RESTART_S = 15.0


LISTEN, ESTABLISHED = "0A", "01"  # TCP states as /proc/net/tcp writes them


def sockets_of(pid: int) -> set[str]:
    """The inodes of process `pid`'s sockets."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link.removeprefix("socket:[").removesuffix("]"))
    return inodes


def tcp_sockets(port: int, state: str) -> set[str]:
    """The inodes of the TCP sockets in `state` on the local `port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == state:
                inodes.add(fields[9])
    return inodes


@pytest.mark.slow
@pytest.mark.alone  # it judges how soon the killed replica is back
async def test_replicas_share_the_port_and_one_killed_leaves_the_other_serving(
    chat_model: Path, tmp_path: Path
) -> None:
    deployment = start_serve(chat_model, tmp_path / "discovery", *MOCKER)
    clients = [httpx.AsyncClient(base_url=deployment.url, timeout=30) for _ in range(CLIENTS)]
    body = {"model": deployment.model, "prompt": "Hi", "max_tokens": 3}
    try:
        port = int(deployment.url.rsplit(":", 1)[1])
        pids = [int(serve_slot(deployment, f"frontend-{i}")["pid"]) for i in range(2)]
        for client in clients:  # each keeps its connection open
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        held = [len(sockets_of(pid) & tcp_sockets(port, ESTABLISHED)) for pid in pids]
        assert min(held) > 0 and sum(held) >= CLIENTS, held
        listening = sockets_of(pids[0]) & tcp_sockets(port, LISTEN)
        assert listening

        os.kill(pids[0], signal.SIGKILL)
        # Its socket closes once its last thread has exited: a new connection the kernel gives
        # it before then is reset. (The process shows as a zombie as soon as its first thread
        # has exited, while the others still hold its files.)
        await wait_until(
            lambda: not listening & tcp_sockets(port, LISTEN),
            10,
            "the killed frontend's listening socket closed",
        )
        for i in range(CLIENTS):  # new connections: the other replica's, or the new one's
            async with httpx.AsyncClient(base_url=deployment.url, timeout=30) as new:
                try:
                    answer = await new.post("/v1/completions", json=body)
                except httpx.TransportError as exc:  # say where the replicas were then
                    slots = [serve_slot(deployment, f"frontend-{j}") for j in range(2)]
                    raise AssertionError(
                        f"new connection {i} failed: {exc!r}; slots {slots}; serve's last "
                        f"log lines:\n" + "\n".join(deployment.lines[-40:])
                    ) from exc
                assert answer.status_code == 200

        def back() -> bool:
            slot = serve_slot(deployment, "frontend-0")
            return bool(slot["pid"] != pids[0] and slot["state"] == "ready")

        await wait_until(back, RESTART_S, "the killed frontend back")
        assert serve_slot(deployment, "frontend-0")["restarts"] == 1
        assert serve_slot(deployment, "frontend-1")["pid"] == pids[1]
    finally:
        for client in clients:
            await client.aclose()
        stop_cleanly(deployment)


@pytest.mark.parametrize("shared", [False, True], ids=["held", "held-shared"])
def test_serve_refuses_a_port_that_another_process_holds(chat_model: Path, shared: bool) -> None:
    """Another process's port, even one that lets others share it (another serve's), is
    refused at once: two deployments never split one port's connections."""
    with bound("127.0.0.1", 0, reuse_port=shared) as other:
        other.listen()
        port = other.getsockname()[1]
        command = ["serve", "--model", str(chat_model), "--engine", "mocker"]
        done = subprocess.run(
            [sys.executable, "-m", "kvbaton", *command, "--http-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
        )
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
