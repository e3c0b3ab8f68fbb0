"""Serving on `--discovery kubernetes` (the API stand-in): a frontend and two mocker workers, each
in a "pod". A kubelet stand-in sets each pod's Ready condition from its worker's /health on the
system port, as a readinessProbe would. Workers that serve are not routed to until their pods
are Ready, and a pod that turns not Ready gets no more requests until it is Ready again."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvbaton.runtime.discovery import kube_objects as ko
from tests.frontend.conftest import Deployment, start_frontend, stop_cleanly
from tests.helpers import clean_env
from tests.servers import KubeStandIn, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

NS = "t"
PODS = ("worker-a", "worker-b")
STARTUP_S = 120.0


class Cluster:
    """Pods in one namespace of the stand-in, and the kubelet stand-in that probes them."""

    def __init__(self, kube: KubeStandIn, namespace: str, tmp_path: Path) -> None:
        self.kube, self.namespace, self.tmp_path = kube, namespace, tmp_path
        self.http = httpx.AsyncClient(base_url=kube.api, timeout=5.0)
        self.system_ports = {pod: free_port() for pod in PODS}
        self.probing = set(PODS)  # the pods whose readiness follows their worker's /health
        self.procs: list[subprocess.Popen[bytes]] = []
        self.marked: dict[str, bool] = {}  # each pod's Ready condition as last set

    async def set_ready(self, pod: str, ready: bool) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod, "namespace": self.namespace, "uid": f"uid-{pod}"},
            "status": {"conditions": [{"type": "Ready", "status": str(ready)}]},
        }
        url = f"/api/v1/namespaces/{self.namespace}/pods"
        headers = {"Content-Type": "application/merge-patch+json"}
        response = await self.http.patch(f"{url}/{pod}", json=body, headers=headers)
        if response.status_code == 404:
            response = await self.http.post(url, json=body)
        response.raise_for_status()
        self.marked[pod] = ready

    async def kubelet(self) -> None:
        """Every 0.2 s: each probed pod is Ready exactly when its worker's /health is 200."""
        while True:
            for pod in sorted(self.probing):
                try:
                    async with httpx.AsyncClient(timeout=1.0) as probe:
                        answer = await probe.get(
                            f"http://127.0.0.1:{self.system_ports[pod]}/health"
                        )
                    ready = answer.status_code == 200
                except httpx.TransportError:
                    ready = False
                if self.marked.get(pod) != ready and pod in self.probing:
                    await self.set_ready(pod, ready)
            await asyncio.sleep(0.2)

    def start_worker(self, pod: str, model: Path) -> None:
        log = open(self.tmp_path / f"{pod}.log", "wb")  # noqa: SIM115 (closed below)
        env = clean_env() | {"POD_NAME": pod, "POD_UID": f"uid-{pod}"}
        self.procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvbaton",
                    "worker",
                    "--engine",
                    "mocker",
                    "--model",
                    str(model),
                    "--namespace",
                    NS,
                    "--discovery",
                    self.kube.url(self.namespace),
                    "--system-port",
                    str(self.system_ports[pod]),
                    "--speedup-ratio",
                    "10",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
        log.close()

    async def instance_of(self, pod: str) -> str:
        """The instance id (hex) of the worker in `pod`: its lease's name ends with it."""
        url = f"/apis/{ko.API_VERSION}/namespaces/{self.namespace}/{ko.PLURAL}"
        items = (await self.http.get(url)).json()["items"]
        (name,) = [o["metadata"]["name"] for o in items if o["spec"].get("pod") == pod]
        return str(name.rpartition("-")[2])

    async def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                await asyncio.to_thread(proc.wait, 20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        await self.http.aclose()


@pytest.fixture
async def cluster(kube_standin: KubeStandIn, tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(kube_standin, f"t-{uuid.uuid4().hex[:12]}", tmp_path)
    try:
        yield cluster
    finally:
        await cluster.close()


@contextlib.asynccontextmanager
async def frontend(cluster: Cluster) -> AsyncIterator[Deployment]:
    url = cluster.kube.url(cluster.namespace)
    deployment = await asyncio.to_thread(start_frontend, url, NS, "--router-mode", "round-robin")
    try:
        yield deployment
    finally:
        await asyncio.to_thread(stop_cleanly, deployment)


async def until(check: Any, what: str, timeout: float = STARTUP_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.1)


async def served_by(http: httpx.AsyncClient, model: str, n: int) -> Counter[str]:
    """Who served `n` requests (the x-kvbaton-worker header of each)."""
    workers: Counter[str] = Counter()
    for i in range(n):
        response = await http.post(
            "/v1/completions", json={"model": model, "prompt": f"request {i}", "max_tokens": 4}
        )
        assert response.status_code == 200, response.text
        workers[response.headers["x-kvbaton-worker"]] += 1
    return workers


async def test_requests_go_only_to_workers_whose_pods_are_ready(
    cluster: Cluster, chat_model: Path
) -> None:
    for pod in PODS:
        await cluster.set_ready(pod, False)  # created by "the scheduler", not ready yet
        cluster.start_worker(pod, chat_model)

    async def workers_healthy() -> bool:
        for port in cluster.system_ports.values():
            with contextlib.suppress(httpx.TransportError):
                async with httpx.AsyncClient(timeout=1.0) as probe:
                    if (await probe.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        continue
            return False
        return True

    await until(workers_healthy, "both workers serve")
    async with frontend(cluster) as front, httpx.AsyncClient(base_url=front.url) as http:

        async def instances() -> list[Any]:
            models = (await http.get("/health")).json()["models"]
            return list(models.get(chat_model.name, []))

        # Both registered and serving; only worker-a's pod turns Ready. Once the frontend
        # routes to worker-a it has read both registrations: worker-b's is not routed to.
        cluster.probing = {"worker-a"}
        kubelet = asyncio.create_task(cluster.kubelet())
        try:
            await until(lambda: _is(instances, 1), "worker-a's pod ready and routed to")
            a, b = await cluster.instance_of("worker-a"), await cluster.instance_of("worker-b")
            assert await instances() == [a]

            cluster.probing.add("worker-b")
            await until(lambda: _is(instances, 2), "both pods ready and routed to", 10.0)
            assert await served_by(http, chat_model.name, 10) == {a: 5, b: 5}

            # worker-a's readiness probe fails (as it would under a stuck engine).
            cluster.probing.discard("worker-a")
            await cluster.set_ready("worker-a", False)
            await until(lambda: _is(instances, 1), "worker-a's pod not ready: dropped", 10.0)
            assert await served_by(http, chat_model.name, 10) == {b: 10}

            cluster.probing.add("worker-a")  # the probe passes again
            await until(lambda: _is(instances, 2), "worker-a's pod ready again", 10.0)
            assert set(await served_by(http, chat_model.name, 10)) == {a, b}
        finally:
            kubelet.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await kubelet


async def _is(instances: Any, n: int) -> bool:
    return len(await instances()) == n
