"""The planner's connectors: `local` with real echo worker processes seen through discovery,
`kubernetes` against kmock's in-memory Kubernetes API (and a real cluster when KUBECONFIG is
set), and `dry-run`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvbaton.planner.connectors import (
    Connector,
    ConnectorError,
    DryRunConnector,
    make_connector,
)
from kvbaton.planner.connectors.local import LocalConnector
from kvbaton.planner.planner import Planner, PlannerMetrics, Predictors
from kvbaton.planner.predictors import make_predictor
from kvbaton.planner.replicas import ReplicaPlanner, ReplicaPolicy
from kvbaton.planner.types import Decision, Observation, Profile, ProfilePoint, Targets
from kvbaton.runtime import DistributedRuntime
from tests.helpers import clean_env, collect, wait_until

STARTUP_S = 30.0  # a cold Python start on a loaded 2-core machine
NS = "serving"
NAMES = {"prefill": "kvbaton-prefill", "decode": "kvbaton-decode"}
DEPLOYMENTS = "apps/v1/deployments"


# -- local


def _echo_args(discovery_url: str, role: str = "decode", lease_ttl: float = 30) -> list[str]:
    # A long lease by default: a stopped worker must leave discovery by deregistering, not by
    # expiring.
    return [
        *("--role", role, "--engine", "echo", "--discovery", discovery_url),
        *("--namespace", "t", "--lease-ttl", str(lease_ttl)),
    ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.integration
async def test_local_scales_0_2_1_0_and_a_stopped_worker_drains_its_stream(
    tmp_path: Path, discovery_url: str
) -> None:
    connector = LocalConnector(
        {"decode": _echo_args(discovery_url)},
        env=clean_env(),
        log_dir=tmp_path / "logs",
        stop_grace_s=20.0,
    )
    assert isinstance(connector, Connector)
    runtime = DistributedRuntime(discovery_url)
    started: list[int] = []
    try:
        generate = await runtime.endpoint("t.backend.generate").client()
        stats = await runtime.endpoint("t.backend.stats").client()
        assert await connector.current() == {"prefill": 0, "decode": 0}

        # 0 -> 2 (asked twice: idempotent)
        await connector.scale("decode", 2)
        await connector.scale("decode", 2)
        assert await connector.current() == {"prefill": 0, "decode": 2}
        started = connector.pids("decode")
        assert len(started) == 2
        await wait_until(
            lambda: len(generate.instance_ids()) == 2 and len(stats.instance_ids()) == 2,
            STARTUP_S,
            "2 workers in discovery",
        )
        instance_of = {}
        for iid in stats.instance_ids():
            instance_of[(await collect(stats.direct(None, iid)))[0]["pid"]] = iid
        assert set(instance_of) == set(started)
        oldest, newest = instance_of[started[0]], instance_of[started[1]]

        # 2 -> 1 with a stream in flight on the worker that goes (the newest)
        stream = generate.direct({"n": 40, "delay": 0.01}, newest)
        first = await stream.__anext__()
        await connector.scale("decode", 1)
        assert await connector.current() == {"prefill": 0, "decode": 1}
        assert connector.pids("decode") == started[:1]
        rest = await collect(stream)
        items = [first, *rest]
        assert [o["i"] for o in items] == list(range(40)), "the stream was cut short"
        assert {o["pid"] for o in items} == {started[1]}
        await wait_until(
            lambda: generate.instance_ids() == [oldest], 5.0, "the stopped worker deregistered"
        )
        await wait_until(lambda: not connector.stopping_pids(), 15.0, "the stopped worker exited")
        assert not _alive(started[1])
        assert connector.exit_code(started[1]) == 0  # it stopped on its own after its SIGTERM

        # 1 -> 0
        await connector.scale("decode", 0)
        assert await connector.current() == {"prefill": 0, "decode": 0}
        await wait_until(lambda: not generate.instance_ids(), 5.0, "the last worker deregistered")
        await wait_until(lambda: not connector.stopping_pids(), 15.0, "the last worker exited")
        assert not _alive(started[0])

        # 0 -> 1, then close() stops it
        await connector.scale("decode", 1)
        started += connector.pids("decode")
        await wait_until(lambda: len(generate.instance_ids()) == 1, STARTUP_S, "a new worker")
    finally:
        await connector.close()
        await runtime.shutdown()
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "decode-1.log",
        "decode-2.log",
        "decode-3.log",
    ]
    assert not [pid for pid in started if _alive(pid)]
    assert await connector.current() == {"prefill": 0, "decode": 0}
    with pytest.raises(RuntimeError, match="closed"):
        await connector.scale("decode", 1)


PLANNER_INTERVAL_S = 0.5


class _NoTraffic:
    """The planner's observer for a frontend that sees no requests: every decision keeps each
    pool at its minimum."""

    async def start(self) -> None: ...

    async def observe(self) -> Observation:
        return Observation(interval_s=PLANNER_INTERVAL_S)


@pytest.mark.integration
async def test_the_planner_replaces_a_killed_local_worker_at_its_next_interval(
    tmp_path: Path, discovery_url: str
) -> None:
    """A worker that dies (SIGKILL: no deregistration, no drain) stops counting in `current()`;
    the planner's next decision finds the pool below its target and the connector starts a new
    worker, which registers, while the killed one's lease expires (short TTL)."""
    connector = LocalConnector(
        {"decode": _echo_args(discovery_url, lease_ttl=3)},
        env=clean_env(),
        log_dir=tmp_path / "logs",
        stop_grace_s=10.0,
    )
    registry = CollectorRegistry()
    seen: list[float | None] = []  # the decode count the connector reported at each decision

    def on_decision(observation: Observation, decision: Decision) -> None:
        seen.append(
            registry.get_sample_value("kvbaton_planner_current_replicas", {"role": "decode"})
        )

    profile = Profile(
        engine="echo",
        model="echo",
        prefill=[ProfilePoint(16, 1.0), ProfilePoint(4096, 50.0)],
        decode=[ProfilePoint(1, 1.0), ProfilePoint(8, 8.0)],
    )
    planner = Planner(
        _NoTraffic(),  # type: ignore[arg-type]
        connector,
        ReplicaPlanner(
            profile,
            Targets(ttft_ms=1000, itl_ms=10),
            ReplicaPolicy(min_prefill=0, max_prefill=0, min_decode=2, max_decode=2),
        ),
        Predictors(*(make_predictor("constant") for _ in range(3))),
        interval_s=PLANNER_INTERVAL_S,
        metrics=PlannerMetrics(registry),
        on_decision=on_decision,
    )
    runtime = DistributedRuntime(discovery_url)
    started: list[int] = []
    loop = asyncio.create_task(planner.run())
    try:
        stats = await runtime.endpoint("t.backend.stats").client()

        async def pid_of_each_instance() -> dict[int, int]:
            return {
                (await collect(stats.direct(None, iid)))[0]["pid"]: iid
                for iid in stats.instance_ids()
            }

        # The first decision starts the pool; both workers register.
        await wait_until(lambda: len(connector.pids("decode")) == 2, 10, "the first decision")
        started = connector.pids("decode")
        victim, survivor = started  # the oldest dies
        await wait_until(lambda: len(stats.instance_ids()) == 2, STARTUP_S, "2 in discovery")
        instances = await pid_of_each_instance()
        assert set(instances) == {survivor, victim}

        decisions_before = len(seen)
        os.kill(victim, signal.SIGKILL)  # a process the connector started, by its PID
        await wait_until(
            lambda: victim not in connector.pids("decode") and len(connector.pids("decode")) == 2,
            10,
            "a new worker in the killed one's place",
        )
        [replacement] = set(connector.pids("decode")) - {survivor}
        started.append(replacement)
        assert connector.pids("decode") == [survivor, replacement]  # the survivor untouched
        assert await connector.current() == {"prefill": 0, "decode": 2}
        assert not _alive(victim)
        # The planner's decision replaced it: one saw the pool one short.
        assert 1.0 in seen[decisions_before:], seen
        assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
            "decode-1.log",
            "decode-2.log",
            "decode-3.log",
        ]

        # In discovery: the killed worker's lease expires, the new worker registers.
        await wait_until(
            lambda: (
                instances[victim] not in stats.instance_ids() and len(stats.instance_ids()) == 2
            ),
            STARTUP_S,
            "the killed worker expired and its replacement registered",
        )
        assert set(await pid_of_each_instance()) == {survivor, replacement}
        # ... and the pool stays as it is: no further worker is started.
        assert connector.pids("decode") == [survivor, replacement]
        # Exactly one decision saw the pool short (the first after the death was noticed); it
        # replaced the worker, and every later one found the pool whole.
        after = seen[decisions_before:]
        short = after.index(1.0)
        assert after[:short] == [2.0] * short, seen
        assert set(after[short + 1 :]) == {2.0}, seen
    finally:
        planner.stop()
        try:
            await loop
        finally:
            await connector.close()
            await runtime.shutdown()
    assert not [pid for pid in started if _alive(pid)]


@pytest.mark.integration
async def test_local_close_right_after_starting_leaves_no_process(
    tmp_path: Path, discovery_url: str
) -> None:
    connector = LocalConnector(
        {
            "prefill": _echo_args(discovery_url, "prefill"),
            "decode": _echo_args(discovery_url, "decode"),
        },
        env=clean_env(),
        log_dir=tmp_path / "logs",
        stop_grace_s=10.0,
    )
    await connector.scale("prefill", 1)
    await connector.scale("decode", 2)
    assert await connector.current() == {"prefill": 1, "decode": 2}
    pids = connector.pids("prefill") + connector.pids("decode")
    async with asyncio.timeout(25):
        await connector.close()
    assert not [pid for pid in pids if _alive(pid)]
    await connector.close()  # idempotent


async def test_local_kills_a_worker_that_ignores_sigterm_after_the_grace(
    tmp_path: Path,
) -> None:
    # Stands in for `python`: ignores SIGTERM (and its arguments: -m kvbaton worker ...).
    stubborn = tmp_path / "stubborn"
    stubborn.write_text("#!/bin/sh\ntrap '' TERM\necho started\nwhile :; do sleep 0.05; done\n")
    stubborn.chmod(0o755)
    connector = LocalConnector(
        {"decode": []}, log_dir=tmp_path / "logs", stop_grace_s=0.5, python=str(stubborn)
    )
    try:
        await connector.scale("decode", 1)
        [pid] = connector.pids("decode")
        log_file = tmp_path / "logs" / "decode-1.log"
        await wait_until(lambda: log_file.read_text() == "started\n", 10.0, "the trap is set")
        await connector.scale("decode", 0)
        assert connector.stopping_pids() == [pid]
        await wait_until(lambda: not connector.stopping_pids(), 5.0, "killed after the grace")
        assert not _alive(pid)
        assert connector.exit_code(pid) == -signal.SIGKILL
    finally:
        await connector.close()


async def test_local_gives_each_worker_the_first_free_core_slot(tmp_path: Path) -> None:
    # Stands in for `python`: writes its arguments (-m kvbaton worker ...), then waits.
    recorder = tmp_path / "recorder"
    recorder.write_text('#!/bin/sh\necho "$@"\nexec sleep 60\n')
    recorder.chmod(0o755)
    logs = tmp_path / "logs"
    connector = LocalConnector(
        {"prefill": ["--role", "prefill"], "decode": ["--role", "decode", "--", "--x", "8"]},
        log_dir=logs,
        stop_grace_s=10.0,
        python=str(recorder),
        core_slots=["0", "1"],
    )

    async def args_of(name: str) -> str:
        path = logs / f"{name}.log"
        await wait_until(lambda: path.exists() and path.read_text(), 10.0, f"{name} started")
        return path.read_text().strip()

    try:
        await connector.scale("decode", 2)
        await connector.scale("prefill", 1)
        assert await args_of("decode-1") == "-m kvbaton worker --role decode --cpu-cores 0 -- --x 8"
        assert await args_of("decode-2") == "-m kvbaton worker --role decode --cpu-cores 1 -- --x 8"
        # Every slot held once: the first of the fewest held.
        assert await args_of("prefill-3") == "-m kvbaton worker --role prefill --cpu-cores 0"
        await connector.scale("decode", 1)  # the newest, on core 1, stops
        await wait_until(lambda: not connector.stopping_pids(), 10.0, "decode-2 exited")
        await connector.scale("decode", 2)
        assert await args_of("decode-4") == "-m kvbaton worker --role decode --cpu-cores 1 -- --x 8"
    finally:
        await connector.close()


async def test_local_refuses_negative_replicas_and_unknown_roles(tmp_path: Path) -> None:
    connector = LocalConnector({"decode": ["--engine", "echo"]}, log_dir=tmp_path / "logs")
    with pytest.raises(ValueError, match="below 0"):
        await connector.scale("decode", -1)
    with pytest.raises(ValueError, match="no prefill workers are configured"):
        await connector.scale("prefill", 1)
    await connector.scale("prefill", 0)  # already true
    assert await connector.current() == {"prefill": 0, "decode": 0}
    assert not (tmp_path / "logs").exists()
    await connector.close()


# -- kubernetes, against kmock


def _deployment(name: str, replicas: int | None) -> dict[str, Any]:
    labels = {"app": name}
    spec: dict[str, Any] = {
        "selector": {"matchLabels": labels},
        "template": {
            "metadata": {"labels": labels},
            "spec": {"containers": [{"name": "worker", "image": "kvbaton:latest"}]},
        },
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": spec,
    }


@pytest.fixture
async def kube() -> AsyncIterator[tuple[Any, str]]:
    """kmock's Kubernetes emulator on a loopback port, holding a prefill Deployment (1 replica)
    and a decode one (2); yields the emulator and its URL."""
    kmock = pytest.importorskip("kmock", reason="kmock is in the test extra")
    pytest.importorskip("kubernetes_asyncio", reason="kubernetes-asyncio is not installed")
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        emulator.objects[DEPLOYMENTS, NS, NAMES["prefill"]] = _deployment(NAMES["prefill"], 1)
        emulator.objects[DEPLOYMENTS, NS, NAMES["decode"]] = _deployment(NAMES["decode"], 2)
        yield emulator, str(server.url)


async def _read_replicas(url: str, name: str) -> int:
    """A fresh GET of the Deployment, through a client of its own."""
    from kubernetes_asyncio import client

    async with client.ApiClient(client.Configuration(host=url)) as api:
        deployment = await client.AppsV1Api(api).read_namespaced_deployment(name, NS)
    return deployment.spec.replicas


async def test_kubernetes_reads_and_patches_spec_replicas(kube: tuple[Any, str]) -> None:
    emulator, url = kube
    connector = make_connector("kubernetes", namespace=NS, deployments=NAMES, host=url)
    assert isinstance(connector, Connector)
    try:
        assert await connector.current() == {"prefill": 1, "decode": 2}
        await connector.scale("decode", 3)
        assert await _read_replicas(url, NAMES["decode"]) == 3
        assert await connector.current() == {"prefill": 1, "decode": 3}
        await connector.scale("decode", 3)  # idempotent
        await connector.scale("prefill", 0)
        assert await connector.current() == {"prefill": 0, "decode": 3}
        with pytest.raises(ValueError, match="below 0"):
            await connector.scale("decode", -1)
    finally:
        await connector.close()
    patches = emulator["patch"]
    assert [p.data for p in patches] == [
        {"spec": {"replicas": 3}},
        {"spec": {"replicas": 3}},
        {"spec": {"replicas": 0}},
    ]
    stored = emulator.objects[DEPLOYMENTS, NS, NAMES["decode"]].raw
    assert stored["spec"]["replicas"] == 3
    assert stored == _deployment(NAMES["decode"], 3), "the patch changed more than spec.replicas"


async def test_kubernetes_unset_replicas_read_as_one(kube: tuple[Any, str]) -> None:
    emulator, url = kube
    emulator.objects[DEPLOYMENTS, NS, NAMES["decode"]] = _deployment(NAMES["decode"], None)
    connector = make_connector("kubernetes", namespace=NS, deployments=NAMES, host=url)
    try:
        assert await connector.current() == {"prefill": 1, "decode": 1}
    finally:
        await connector.close()


async def test_kubernetes_missing_deployment_is_a_clear_error(kube: tuple[Any, str]) -> None:
    from kvbaton.planner.connectors.kubernetes import DeploymentNotFoundError

    _, url = kube
    connector = make_connector(
        "kubernetes",
        namespace=NS,
        deployments={"prefill": NAMES["prefill"], "decode": "no-such-decode"},
        host=url,
    )
    try:
        with pytest.raises(DeploymentNotFoundError, match=f"{NS}/no-such-decode \\(decode\\)"):
            await connector.current()
        with pytest.raises(DeploymentNotFoundError, match=r"not found at .* \(cannot scale to 2\)"):
            await connector.scale("decode", 2)
        with pytest.raises(ValueError, match="no agg workers are configured"):
            await connector.scale("agg", 1)
    finally:
        await connector.close()


async def test_kubernetes_unreachable_api_fails_within_the_timeout() -> None:
    pytest.importorskip("kubernetes_asyncio", reason="kubernetes-asyncio is not installed")
    from kvbaton.planner.connectors.kubernetes import KubernetesUnreachableError

    # A closed port: refused at once.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    refused = make_connector(
        "kubernetes", namespace=NS, deployments=NAMES, host=f"http://127.0.0.1:{port}"
    )
    try:
        async with asyncio.timeout(5):
            with pytest.raises(KubernetesUnreachableError, match="unreachable"):
                await refused.current()
    finally:
        await refused.close()

    # A server that accepts and never answers: bounded by request_timeout.
    writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    silent_api = make_connector(
        "kubernetes",
        namespace=NS,
        deployments=NAMES,
        host=f"http://127.0.0.1:{port}",
        request_timeout=0.5,
    )
    try:
        async with asyncio.timeout(5):
            with pytest.raises(KubernetesUnreachableError, match=r"did not answer within 0\.5s"):
                await silent_api.scale("decode", 2)
    finally:
        await silent_api.close()
        server.close()
        for writer in writers:
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await writer.wait_closed()
        async with asyncio.timeout(2):
            await server.wait_closed()


async def test_kubernetes_config_from_kubeconfig_and_none_found(
    kube: tuple[Any, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = kube
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: stand-in
  cluster: {{server: "{url}"}}
users:
- name: planner
  user: {{token: not-checked}}
contexts:
- name: test
  context: {{cluster: stand-in, user: planner}}
current-context: test
"""
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    connector = make_connector("kubernetes", namespace=NS, deployments=NAMES)
    try:
        assert await connector.current() == {"prefill": 1, "decode": 2}
    finally:
        await connector.close()

    monkeypatch.delenv("KUBECONFIG")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.kube/config
    connector = make_connector("kubernetes", namespace=NS, deployments=NAMES)
    try:
        with pytest.raises(ConnectorError, match="no Kubernetes API configured"):
            await connector.current()
    finally:
        await connector.close()


@pytest.mark.skipif(
    not os.environ.get("KUBECONFIG"), reason="no KUBECONFIG set: no real cluster to scale"
)
async def test_kubernetes_real_cluster() -> None:
    """Creates two throwaway Deployments (a pause container; namespace from
    $KVBATON_TEST_K8S_NAMESPACE, default "default"), scales them and deletes them."""
    pytest.importorskip("kubernetes_asyncio", reason="kubernetes-asyncio is not installed")
    from kubernetes_asyncio import client, config

    namespace = os.environ.get("KVBATON_TEST_K8S_NAMESPACE", "default")
    suffix = uuid.uuid4().hex[:8]
    names = {role: f"kvbaton-test-{role}-{suffix}" for role in ("prefill", "decode")}
    configuration = client.Configuration()
    await config.load_kube_config(client_configuration=configuration, persist_config=False)
    async with client.ApiClient(configuration) as api:
        apps = client.AppsV1Api(api)
        for name in names.values():
            body = _deployment(name, 0)
            body["metadata"]["namespace"] = namespace
            body["spec"]["template"]["spec"]["containers"][0]["image"] = "registry.k8s.io/pause:3.9"
            await apps.create_namespaced_deployment(namespace, body, _request_timeout=30)
        connector = make_connector("kubernetes", namespace=namespace, deployments=names)
        try:
            async with asyncio.timeout(60):
                assert await connector.current() == {"prefill": 0, "decode": 0}
                await connector.scale("decode", 2)
                deployment = await apps.read_namespaced_deployment(names["decode"], namespace)
                assert deployment.spec.replicas == 2
                assert await connector.current() == {"prefill": 0, "decode": 2}
                await connector.scale("decode", 0)
        finally:
            await connector.close()
            for name in names.values():
                with contextlib.suppress(Exception):
                    await apps.delete_namespaced_deployment(name, namespace, _request_timeout=30)


# -- dry run


async def test_dry_run_over_local_starts_nothing_and_logs_the_decision(
    tmp_path: Path, discovery_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvbaton.planner.connectors")
    connector = make_connector(
        "local",
        dry_run=True,
        worker_args={"decode": _echo_args(discovery_url)},
        log_dir=tmp_path / "logs",
    )
    assert isinstance(connector, DryRunConnector)
    inner = connector.inner
    assert isinstance(inner, LocalConnector)
    await connector.scale("decode", 2)
    assert await connector.current() == {"prefill": 0, "decode": 0}
    assert inner.pids("decode") == []
    assert not (tmp_path / "logs").exists()
    assert connector.requested == {"decode": 2}
    assert "dry run: would scale decode from 0 to 2" in caplog.text
    await connector.close()


async def test_dry_run_over_kubernetes_reads_but_never_patches(
    kube: tuple[Any, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvbaton.planner.connectors")
    emulator, url = kube
    connector = make_connector(
        "kubernetes", dry_run=True, namespace=NS, deployments=NAMES, host=url
    )
    try:
        assert await connector.current() == {"prefill": 1, "decode": 2}
        await connector.scale("decode", 5)
        await connector.scale("prefill", 0)
        assert await connector.current() == {"prefill": 1, "decode": 2}
    finally:
        await connector.close()
    assert len(emulator["patch"]) == 0
    assert await _read_replicas(url, NAMES["decode"]) == 2
    assert "dry run: would scale decode from 2 to 5" in caplog.text
    assert "dry run: would scale prefill from 1 to 0" in caplog.text


async def test_dry_run_alone_counts_and_unknown_names_are_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvbaton.planner.connectors")
    connector = make_connector("dry-run", initial={"decode": 2})
    assert isinstance(connector, DryRunConnector)
    assert await connector.current() == {"prefill": 0, "decode": 2}
    await connector.scale("decode", 4)
    await connector.scale("prefill", 1)
    await connector.scale("decode", 1)
    assert await connector.current() == {"prefill": 0, "decode": 2}  # nothing changed
    assert connector.calls == [("decode", 4), ("prefill", 1), ("decode", 1)]
    assert connector.requested == {"decode": 1, "prefill": 1}
    assert "dry run: would scale decode from 2 to 4" in caplog.text
    with pytest.raises(ValueError):
        await connector.scale("decode", -1)
    await connector.close()
    with pytest.raises(ValueError, match="unknown connector 'swarm'"):
        make_connector("swarm")


@pytest.fixture(scope="module")
def mocker_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import build_chat_model

    return build_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")


async def test_a_mocker_worker_stopped_mid_request_finishes_it_first(
    tmp_path: Path, mocker_model_dir: Path
) -> None:
    """What the local connector's scale-down relies on for LLM workers: SIGTERM deregisters
    the worker at once, and the requests it is running finish on its engine before it stops."""
    from kvbaton.protocols.llm import EngineOutput, PreprocessedRequest, SamplingParams

    discovery = f"file://{tmp_path / 'discovery'}"
    args = [
        "--role", "decode", "--engine", "mocker", "--model", str(mocker_model_dir),
        "--max-model-len", "4096", "--namespace", "t", f"--discovery={discovery}",
    ]  # fmt: skip
    connector = LocalConnector({"decode": args}, env=clean_env(), log_dir=tmp_path / "logs")
    async with DistributedRuntime(discovery) as runtime:
        generate = await runtime.endpoint("t.backend.generate").client(response_type=EngineOutput)
        try:
            await connector.scale("decode", 1)
            (worker,) = await generate.wait_for_instances(60)
            request = PreprocessedRequest(
                model=mocker_model_dir.name,
                token_ids=list(range(20, 84)),
                sampling=SamplingParams(max_tokens=300, min_tokens=300, ignore_eos=True),
            )
            stream = generate.direct(request, worker)
            tokens = len((await anext(stream)).token_ids)
            await connector.scale("decode", 0)  # SIGTERM while it decodes (about 2 s to go)
            async for output in stream:
                tokens += len(output.token_ids)
            assert tokens == 300
            await wait_until(lambda: not generate.instance_ids(), 5, "the worker gone")
        finally:
            await connector.close()
