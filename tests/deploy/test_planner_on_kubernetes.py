"""The planner of `kvbaton deploy kubernetes --with-planner`, run as its Deployment's command says
(the frontend's URL and the API server's aside) against the API stand-in holding the generated
Deployments: a real `kvbaton planner` process scales the decode Deployment up to its minimum."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvbaton.deploy.kubernetes import KubernetesOptions, manifests
from kvbaton.planner.types import Profile, ProfilePoint
from tests.frontend.conftest import start_frontend, stop_cleanly
from tests.helpers import clean_env
from tests.servers import KubeStandIn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROFILE = Profile(
    engine="mocker",
    model="tiny-chat",
    prefill=[ProfilePoint(16, 5.0), ProfilePoint(4096, 50.0)],
    decode=[ProfilePoint(1, 5.0), ProfilePoint(8, 40.0)],
    decode_context=256,
)


def planner_command(objects: list[dict[str, Any]]) -> list[str]:
    (planner,) = [
        o
        for o in objects
        if o["metadata"]["name"].endswith("-planner") and (o["kind"] == "Deployment")
    ]
    command: list[str] = planner["spec"]["template"]["spec"]["containers"][0]["command"]
    return command


def with_flag(command: list[str], flag: str, value: str) -> list[str]:
    """`command` with `flag`'s value replaced (or the flag added)."""
    if flag in command:
        i = command.index(flag)
        return [*command[: i + 1], value, *command[i + 2 :]]
    return [*command, flag, value]


def spawn(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kvbaton", *command[1:]],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=clean_env(),
        )


async def test_the_generated_planner_scales_the_generated_decode_deployment(
    kube_standin: KubeStandIn, tmp_path: Path
) -> None:
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    options = KubernetesOptions(
        mode="disagg",
        decode=1,
        with_planner=True,
        planner_profile=PROFILE.to_json().decode(),
        ttft_ms=500.0,
        itl_ms=50.0,
        min_decode=2,
        k8s_namespace=namespace,
    )
    objects = manifests(options)
    async with httpx.AsyncClient(base_url=kube_standin.api, timeout=5.0) as api:
        for obj in objects:
            if obj["kind"] == "Deployment":
                url = f"/apis/apps/v1/namespaces/{namespace}/deployments"
                (await api.post(url, json=obj)).raise_for_status()
        decode_url = f"/apis/apps/v1/namespaces/{namespace}/deployments/kvbaton-decode"

        async def decode_replicas() -> int:
            replicas: int = (await api.get(decode_url)).json()["spec"]["replicas"]
            return replicas

        assert await decode_replicas() == 1
        discovery = kube_standin.url(namespace)
        front = await asyncio.to_thread(start_frontend, discovery, options.kvbaton_namespace)
        profile = tmp_path / "profile.json"
        profile.write_bytes(PROFILE.to_json())
        command = planner_command(objects)
        assert command[:2] == ["kvbaton", "planner"]
        for flag, value in (
            ("--frontend", front.url),  # (in the cluster: the frontend's Service)
            ("--profile", str(profile)),  # (in the cluster: the ConfigMap's file)
            ("--k8s-host", kube_standin.api),  # (in the cluster: the service account)
            ("--discovery", discovery),  # (in the cluster: KVBATON_DISCOVERY=kubernetes)
            ("--interval", "1"),
        ):
            command = with_flag(command, flag, value)
        log = tmp_path / "planner.log"
        planner = spawn(command, log)
        try:
            deadline = time.monotonic() + 60
            while await decode_replicas() != 2:
                assert planner.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                await asyncio.sleep(0.2)
            prefill_url = decode_url.replace("kvbaton-decode", "kvbaton-prefill")
            assert (await api.get(prefill_url)).json()["spec"]["replicas"] == 1
        finally:
            planner.send_signal(signal.SIGTERM)
            planner.wait(timeout=20)
            await asyncio.to_thread(stop_cleanly, front)
