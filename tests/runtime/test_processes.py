"""The runtime across real processes: `kvbaton worker --engine echo` processes called from the
test process. The tests of the runtime's contract run on each discovery backend that spans
processes (file, etcd) and on each request plane (tcp, nats, http); the ones about one plane's
own wire (garbage on a TCP port) run on that plane."""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvbaton.protocols.frames import Data, Request
from kvbaton.runtime import (
    Client,
    DistributedRuntime,
    HandlerError,
    StreamBrokenError,
)
from kvbaton.runtime.request_plane.framing import HEADER, encode_frame, encode_payload
from tests.conftest import WorkerFactory
from tests.helpers import clean_env, collect, wait_until

pytestmark = pytest.mark.integration

TTL = 2.0
STARTUP_S = 30.0  # a cold Python start on a loaded 2-core machine


DEPLOYMENTS = ["file/tcp", "etcd/tcp", "kubernetes/tcp", "file/nats", "file/http"]
every_deployment = pytest.mark.parametrize("backends", DEPLOYMENTS, indirect=True)
# etcd looks for expired leases every 500 ms: a key may outlive its TTL by that much.
# kubernetes: watchers look for leases renewed too long ago every TTL/8.
EXPIRY_SLACK_S = {"file": 0.3, "etcd": 0.8, "kubernetes": 0.6}


@dataclass
class Backends:
    discovery: str  # "file", "etcd" or "kubernetes"
    plane: str
    settings: dict[str, Any]  # RuntimeSettings fields for the test's runtime
    flags: list[str]  # the same for a worker's command line


@pytest.fixture
def backends(request: pytest.FixtureRequest, tmp_path: Path) -> Backends:
    discovery, plane = getattr(request, "param", "file/tcp").split("/")
    if discovery == "etcd":
        url = f"{request.getfixturevalue('etcd_server').url}/t-{uuid.uuid4().hex}"
    elif discovery == "kubernetes":
        url = request.getfixturevalue("kube_standin").url(f"t-{uuid.uuid4().hex[:12]}")
    else:
        url = f"file://{tmp_path / 'discovery'}"
    settings: dict[str, Any] = {"discovery": url, "request_plane": plane}
    if plane == "nats":
        settings["nats_url"] = request.getfixturevalue("nats_server").url
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items() if k != "discovery"]
    return Backends(discovery, plane, settings, flags)


@pytest.fixture
def discovery_url(backends: Backends) -> str:
    """The discovery `spawn_worker` (tests/conftest.py) gives its workers."""
    return backends.settings["discovery"]


@pytest.fixture
def spawn_worker(spawn_worker: WorkerFactory, backends: Backends) -> WorkerFactory:
    """Workers on the test's request plane."""

    def spawn(*extra: str, **kw: Any) -> subprocess.Popen[bytes]:
        return spawn_worker(*backends.flags, *extra, **kw)

    return spawn


@pytest.fixture
async def runtime(backends: Backends) -> AsyncIterator[DistributedRuntime]:
    rt = DistributedRuntime(**backends.settings, lease_ttl=TTL)
    yield rt
    await rt.shutdown()


async def clients(runtime: DistributedRuntime, n: int) -> tuple[Client, Client, dict[int, int]]:
    """Clients of generate and stats once `n` workers serve both; maps instance id -> pid."""
    generate = await runtime.endpoint("t.backend.generate").client()
    stats = await runtime.endpoint("t.backend.stats").client()
    await wait_until(
        lambda: len(generate.instance_ids()) == n and len(stats.instance_ids()) == n,
        STARTUP_S,
        f"{n} workers serving",
    )
    pids = {}
    for iid in stats.instance_ids():
        pids[iid] = (await collect(stats.direct(None, iid)))[0]["pid"]
    return generate, stats, pids


async def worker_stats(stats: Client, iid: int) -> dict[str, Any]:
    result: dict[str, Any] = (await collect(stats.direct(None, iid)))[0]
    return result


def kill9(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


@every_deployment
async def test_round_robin_1000_requests_then_kill_9_fails_over_at_once(
    spawn_worker: WorkerFactory, runtime: DistributedRuntime, backends: Backends
) -> None:
    procs = [spawn_worker(), spawn_worker()]
    generate, stats, pids = await clients(runtime, 2)
    gate = asyncio.Semaphore(64)

    async def call(i: int) -> int:
        async with gate:
            out = await collect(generate.round_robin({"k": i}))
        assert [o["echo"] for o in out] == [{"k": i}]
        return int(out[0]["instance_id"])

    served_by = Counter(await asyncio.gather(*(call(i) for i in range(1000))))
    assert sorted(served_by.values()) == [500, 500]
    assert {iid: (await worker_stats(stats, iid))["served"] for iid in pids} == dict(served_by)

    victim_iid = next(i for i, pid in pids.items() if pid == procs[0].pid)
    survivor_iid = next(i for i in pids if i != victim_iid)
    victim_address = next(i.address for i in generate.instances() if i.instance_id == victim_iid)
    kill9(procs[0])
    # The next call to the victim fails to connect, so the victim is quarantined at once, long
    # before its lease runs out. (Over tcp the pooled connection sees the close first.)
    if backends.plane == "tcp":
        await wait_until(lambda: victim_address not in runtime.request_client.connections(), 5)
    t0 = time.monotonic()
    after = Counter(await asyncio.gather(*(call(i) for i in range(200))))
    assert after == {survivor_iid: 200}
    assert generate.instance_ids() == [survivor_iid]
    assert time.monotonic() - t0 < TTL / 2


@every_deployment
async def test_killed_worker_leaves_instance_ids_within_the_lease_ttl(
    spawn_worker: WorkerFactory, runtime: DistributedRuntime, backends: Backends
) -> None:
    procs = [spawn_worker(lease_ttl=TTL), spawn_worker(lease_ttl=TTL)]
    generate, _, pids = await clients(runtime, 2)
    victim_iid = next(i for i, pid in pids.items() if pid == procs[1].pid)
    kill9(procs[1])
    waited = await wait_until(
        lambda: victim_iid not in generate.instance_ids(), TTL + 3, "dead worker dropped"
    )
    slack = EXPIRY_SLACK_S[backends.discovery]
    assert waited <= TTL + slack, f"dropped after {waited:.2f}s, TTL is {TTL}s"
    assert generate.instance_ids() == [i for i in pids if i != victim_iid]
    assert len(await collect(generate.round_robin("still there"))) == 1  # the survivor serves


@every_deployment
async def test_cancellation_reaches_the_handler_in_another_process(
    spawn_worker: WorkerFactory, runtime: DistributedRuntime
) -> None:
    spawn_worker()
    generate, stats, pids = await clients(runtime, 1)
    (iid,) = pids
    stream = generate.round_robin({"n": 100_000, "delay": 0.005})
    for _ in range(3):
        await stream.__anext__()
    assert (await worker_stats(stats, iid))["in_flight"] == 1
    await stream.aclose()
    t0 = time.monotonic()
    while (s := await worker_stats(stats, iid))["cancelled"] != 1:
        assert time.monotonic() - t0 < 1.0, s
    assert s["in_flight"] == 0 and s["served"] == 0


@every_deployment
async def test_a_break_out_of_the_loop_cancels_the_remote_handler(
    spawn_worker: WorkerFactory, runtime: DistributedRuntime
) -> None:
    spawn_worker()
    generate, stats, pids = await clients(runtime, 1)
    (iid,) = pids
    async for item in generate.round_robin({"n": 100_000, "delay": 0.005}):
        if item["i"] == 2:
            break
    t0 = time.monotonic()
    while (await worker_stats(stats, iid))["cancelled"] != 1:
        assert time.monotonic() - t0 < 1.0


@every_deployment
async def test_handler_error_reaches_the_caller(
    spawn_worker: WorkerFactory, runtime: DistributedRuntime
) -> None:
    spawn_worker()
    generate, _, _ = await clients(runtime, 1)
    got = []
    with pytest.raises(HandlerError) as info:
        async for item in generate.round_robin({"n": 2, "fail": "boom at the end"}):
            got.append(item["i"])
    assert got == [0, 1]
    assert info.value.error_type == "ValueError"
    assert info.value.message == "boom at the end"


@every_deployment
async def test_worker_death_mid_stream_is_a_broken_stream(
    spawn_worker: WorkerFactory, runtime: DistributedRuntime
) -> None:
    proc = spawn_worker()
    generate, _, _ = await clients(runtime, 1)
    stream = generate.round_robin({"n": 100_000, "delay": 0.005})
    await stream.__anext__()
    kill9(proc)
    with pytest.raises(StreamBrokenError):
        async for _ in stream:
            pass


@every_deployment
async def test_500_concurrent_streams_over_one_connection(
    spawn_worker: WorkerFactory, runtime: DistributedRuntime
) -> None:
    spawn_worker()
    generate, _, pids = await clients(runtime, 1)
    (iid,) = pids

    async def one(k: int) -> list[int]:
        return [o["i"] for o in await collect(generate.direct({"n": 20, "k": k}, iid))]

    results = await asyncio.gather(*(one(k) for k in range(500)))
    assert results == [list(range(20))] * 500
    assert len(runtime.request_client.connections()) == 1


def _garbage(seed: int) -> list[bytes]:
    """Hostile inputs: random bytes, a header promising more than comes, an oversized length,
    a frame of an unknown type, half a header, a valid request with a truncated payload."""
    rng = random.Random(seed)
    request = encode_frame(Request(1, "t.backend.generate", "r", encode_payload({"n": 1})), 1 << 20)
    return [
        rng.randbytes(4096),
        HEADER.pack(100) + rng.randbytes(50),
        HEADER.pack(2**31) + b"x" * 16,
        HEADER.pack(3) + msgspec.msgpack.encode([77, 1])[:3],
        b"\x00\x00",
        request[: len(request) - 3],
        encode_frame(Data(1, [encode_payload("a client may not send data")]), 1 << 20),
    ]


async def test_garbage_on_the_port_disturbs_no_other_client(
    spawn_worker: WorkerFactory, runtime: DistributedRuntime
) -> None:
    proc = spawn_worker()
    generate, _, pids = await clients(runtime, 1)
    (iid,) = pids
    host, port = generate.instances()[0].address.removeprefix("tcp://").rsplit(":", 1)
    long_stream = asyncio.create_task(collect(generate.direct({"n": 100, "delay": 0.01}, iid)))

    def attack(payload: bytes) -> None:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)  # then wait for the server to close its side
            while sock.recv(65536):
                pass

    for seed in range(5):
        for payload in _garbage(seed):
            await asyncio.to_thread(attack, payload)
            assert len(await collect(generate.direct({"n": 3}, iid))) == 3
    assert [o["i"] for o in await long_stream] == list(range(100))
    assert proc.poll() is None


@every_deployment
async def test_sigterm_drains_in_flight_and_deregisters_at_once(
    spawn_worker: WorkerFactory, runtime: DistributedRuntime
) -> None:
    proc = spawn_worker(lease_ttl=30.0)  # deregistration must not wait for the TTL
    generate, _, _ = await clients(runtime, 1)
    stream = generate.round_robin({"n": 40, "delay": 0.01})
    first = await stream.__anext__()
    proc.send_signal(signal.SIGTERM)
    rest = await collect(stream)
    assert [first["i"]] + [o["i"] for o in rest] == list(range(40))
    assert proc.wait(timeout=15) == 0
    await wait_until(lambda: not generate.instance_ids(), 2.0, "deregistered")


def _kvbaton(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbaton", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )


@every_deployment
async def test_status_lists_instances_as_a_table(
    spawn_worker: WorkerFactory, runtime: DistributedRuntime, discovery_url: str
) -> None:
    proc = spawn_worker()
    generate, _, pids = await clients(runtime, 1)
    (iid,) = pids
    address = generate.instances()[0].address
    out = (await asyncio.to_thread(_kvbaton, "status", "--discovery", discovery_url)).stdout
    lines = out.splitlines()
    assert lines[1].split() == [
        "NAMESPACE",
        "COMPONENT",
        "ENDPOINT",
        "INSTANCE",
        "ADDRESS",
        "PID",
        "AGE",
    ]
    rows = sorted(line.split()[:6] for line in lines[2:])
    assert rows == [
        ["t", "backend", endpoint, f"{iid:x}", address, str(proc.pid)]
        for endpoint in ("generate", "stats")
    ]
    kill9(proc)
    await wait_until(lambda: not generate.instance_ids(), TTL + 3)
    out = (await asyncio.to_thread(_kvbaton, "status", "--discovery", discovery_url)).stdout
    assert out.splitlines()[1] == "no instances"
