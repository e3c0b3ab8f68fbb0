"""The whole serving path on the servers the field trusts, in separate processes: a frontend
(with its KV router and PrefillRouter) and 2 prefill + 2 decode mocker workers on etcd
discovery and the NATS event plane, each server run by the test on random loopback ports.

What it shows: requests succeed; `kill -9` of a decode worker takes it out of routing within
the lease TTL and its blocks out of the router's index; restarting etcd, and separately NATS,
mid-load loses no registered instance once they are back (workers re-register, the router
re-subscribes), and no request hangs. Requests travel on the tcp request plane, and then on
the nats one."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from kvbaton.protocols.kv import KvDump
from kvbaton.runtime import DistributedRuntime
from tests.conftest import WorkerFactory
from tests.frontend.conftest import (
    Deployment,
    kvbaton_status,
    start_frontend,
    stop_cleanly,
)
from tests.helpers import collect
from tests.servers import EtcdServer, NatsServer, running

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

NS = "t"
TTL = 3.0
REQUEST_TIMEOUT_S = 30.0  # what "hangs" means here: a request not answered in this time
_INDEXED = re.compile(
    r'kvbaton_router_indexed_blocks\{component="([^"]+)",model="[^"]+",worker="([0-9a-f]+)"\} (\d+)'
)


@dataclass
class Cluster:
    etcd: EtcdServer
    nats: NatsServer
    discovery: str
    request_plane: str
    flags: list[str]  # the runtime flags every process takes


@pytest.fixture(params=["tcp", "nats"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    """etcd and NATS; requests on the tcp plane, or through NATS too."""
    with (
        running(EtcdServer(tmp_path / "etcd")) as etcd,
        running(NatsServer(tmp_path / "nats")) as nats,
    ):
        discovery = f"{etcd.url}/kvbaton-{uuid.uuid4().hex[:8]}"
        flags = ["--event-plane", nats.url, "--nats-url", nats.url]
        flags += ["--request-plane", request.param]
        yield Cluster(etcd, nats, discovery, request.param, flags)


@pytest.fixture
def discovery_url(cluster: Cluster) -> str:
    """What `spawn_worker` (tests/conftest.py) gives its workers: the cluster's etcd."""
    return cluster.discovery


def spawn_mocker(
    spawn: WorkerFactory, cluster: Cluster, model: Path, role: str
) -> subprocess.Popen[bytes]:
    return spawn(
        "--model",
        str(model),
        "--role",
        role,
        "--block-size",
        "16",
        "--num-kv-blocks",
        "1024",
        "--max-model-len",
        "4096",
        "--speedup-ratio",
        "10",
        *cluster.flags,
        engine="mocker",
        lease_ttl=TTL,
        namespace=NS,
    )


@pytest.fixture
async def frontend(cluster: Cluster) -> AsyncIterator[Deployment]:
    deployment = await asyncio.to_thread(start_frontend, cluster.discovery, NS, *cluster.flags)
    try:
        yield deployment
    finally:
        await asyncio.to_thread(stop_cleanly, deployment)


async def health(http: httpx.AsyncClient) -> tuple[set[str], set[str]]:
    """(decode instances, prefill instances) the frontend routes to."""
    body = (await http.get("/health")).json()
    decode = {i for ids in body["models"].values() for i in ids}
    prefill = {i for ids in body["prefill"].values() for i in ids}
    return decode, prefill


async def indexed(http: httpx.AsyncClient) -> dict[str, int]:
    """Blocks the router's index holds per decode worker ("backend" component)."""
    text = (await http.get("/metrics")).text
    return {w: int(n) for comp, w, n in _INDEXED.findall(text) if comp.endswith(".backend")}


async def until(check, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
    print(f"{time.strftime('%H:%M:%S')} waiting for: {what}", flush=True)  # shown on a failure
    t0 = time.monotonic()
    while not await check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def chat(client: openai.AsyncOpenAI, model: str, i: int) -> str:
    response = await asyncio.wait_for(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"request {i}: " + "tell me a story " * 8}],
            max_tokens=8,
        ),
        REQUEST_TIMEOUT_S,
    )
    assert response.choices[0].finish_reason == "length"
    return response.choices[0].message.content or ""


class Load:
    """Requests one after another on a few lanes until stopped; counts what happened."""

    def __init__(self, client: openai.AsyncOpenAI, model: str, lanes: int = 4) -> None:
        self.ok = 0
        self.failed: list[str] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._lane(client, model, n)) for n in range(lanes)]

    async def _lane(self, client: openai.AsyncOpenAI, model: str, lane: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                await chat(client, model, lane * 100_000 + i)
                self.ok += 1
            except TimeoutError:
                raise AssertionError("a request hung") from None
            except openai.APIError as exc:  # an answer, not a hang: counted
                self.failed.append(str(exc))

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def test_serving_on_etcd_and_nats_survives_kills_and_server_restarts(
    cluster: Cluster, frontend: Deployment, spawn_worker: WorkerFactory, chat_model: Path
) -> None:
    model = chat_model.name
    decode = [spawn_mocker(spawn_worker, cluster, chat_model, "decode") for _ in range(2)]
    prefill = [spawn_mocker(spawn_worker, cluster, chat_model, "prefill") for _ in range(2)]
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="none", max_retries=0)
    async with httpx.AsyncClient(base_url=frontend.url) as http:

        async def all_up() -> bool:
            d, p = await health(http)
            return len(d) == 2 and len(p) == 2

        await until(all_up, 120, "2 decode and 2 prefill workers routed to")
        decode_ids, prefill_ids = await health(http)

        # Requests succeed, through a prefill worker and a decode worker each.
        await asyncio.gather(*(chat(client, model, i) for i in range(16)))
        table = await asyncio.to_thread(kvbaton_status, cluster.discovery)
        for iid in decode_ids | prefill_ids:
            assert iid in table, table

        # Both decode workers hold blocks in the router's index (events came over NATS).
        async def both_indexed() -> bool:
            blocks = await indexed(http)
            return all(blocks.get(w, 0) > 0 for w in decode_ids)

        await until(both_indexed, 10, "both decode workers' blocks indexed")

        # kill -9 of a decode worker: out of routing within the TTL, its blocks out of the index.
        victim_proc = decode[0]
        victim_proc.send_signal(signal.SIGKILL)
        victim_proc.wait(10)

        async def victim_gone() -> bool:
            d, _ = await health(http)
            return len(d) == 1

        # (etcd looks for expired leases every 500 ms; this polls every 100 ms)
        await until(victim_gone, TTL + 0.8, "the killed decode worker out of routing")
        (survivor,) = (await health(http))[0]
        (victim,) = decode_ids - {survivor}

        async def victim_unindexed() -> bool:
            return victim not in await indexed(http)

        await until(victim_unindexed, 0.5, "the killed worker's blocks out of the index")
        await asyncio.gather(*(chat(client, model, 100 + i) for i in range(8)))

        # Restart etcd mid-load, then NATS mid-load: nothing registered is lost, nothing hangs.
        for restart in (cluster.etcd, cluster.nats):
            print(f"{time.strftime('%H:%M:%S')} restarting {type(restart).__name__}", flush=True)
            load = Load(client, model)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(restart.stop)
            await asyncio.sleep(2.0)
            await asyncio.to_thread(restart.start)
            await asyncio.sleep(2.0)
            await load.stop()
            assert load.ok > 0
            # Streams carried by NATS break while it is down (their requests fail with an
            # error, none hangs: see Load); everything else goes on untouched.
            if restart is cluster.etcd or cluster.request_plane != "nats":
                assert not load.failed, load.failed[:3]

            async def all_back() -> bool:
                d, p = await health(http)
                return d == {survivor} and p == prefill_ids

            await until(
                all_back, 15, f"every instance routed to after the {type(restart).__name__} restart"
            )
            table = await asyncio.to_thread(kvbaton_status, cluster.discovery)
            for iid in {survivor} | prefill_ids:
                assert iid in table, table

        # The router follows the survivor's cache again after NATS came back: after more
        # requests, its index holds exactly what the survivor's cache holds.
        await asyncio.gather(*(chat(client, model, 900 + i) for i in range(8)))
        async with DistributedRuntime(cluster.discovery) as runtime:
            dumps = await runtime.endpoint(f"{NS}.backend.kv_dump").client(response_type=KvDump)
            await dumps.wait_for_instances()
            cached: list[int] = []

            async def index_is_the_cache() -> bool:
                (dump,) = await collect(dumps.direct(None, int(survivor, 16)))
                cached[:] = [len(dump.block_hashes)]
                return (await indexed(http)).get(survivor) == cached[0]

            await until(index_is_the_cache, 15, "the router's index equal to the survivor's cache")
            assert cached[0] > 0
    for proc in [decode[1], *prefill]:
        assert proc.poll() is None  # nobody died of the restarts
