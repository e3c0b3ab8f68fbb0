"""`kvbaton deploy kubernetes`: the objects load into the official Kubernetes client models with
nothing dropped, apply to kmock's in-memory API where the planner's connector scales them, the
CLI prints or writes them and refuses bad input, and the Containerfile installs as the README
says."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from kvbaton.deploy.kubernetes import KubernetesOptions, file_name, manifests, to_yaml
from kvbaton.planner.types import Profile, ProfilePoint

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
NS = "serving"
MODEL_CLASS = {
    "CustomResourceDefinition": "V1CustomResourceDefinition",
    "ServiceAccount": "V1ServiceAccount",
    "Role": "V1Role",
    "RoleBinding": "V1RoleBinding",
    "ConfigMap": "V1ConfigMap",
    "Service": "V1Service",
    "Deployment": "V1Deployment",
    "StatefulSet": "V1StatefulSet",
}
LABELS = {
    "app.kubernetes.io/name": "kvbaton",
    "app.kubernetes.io/part-of": "kvbaton",
    "app.kubernetes.io/managed-by": "kvbaton",
}
PROFILE_POINTS = [ProfilePoint(128, 10.0), ProfilePoint(1024, 60.0)]
PROFILE = Profile(
    engine="mocker",
    model="smollm2",
    prefill=PROFILE_POINTS,
    decode=[ProfilePoint(1, 5.0), ProfilePoint(32, 9.0)],
    decode_context=512,
).to_json()


def _full(**overrides: Any) -> KubernetesOptions:
    """disagg with every option: planner, etcd, NATS, GPUs."""
    options: dict[str, Any] = {
        "mode": "disagg",
        "prefill": 2,
        "decode": 3,
        "with_planner": True,
        "planner_profile": PROFILE.decode(),
        "ttft_ms": 500.0,
        "itl_ms": 40.0,
        "max_decode": 6,
        "with_etcd": True,
        "with_nats": True,
        "gpus_per_worker": 2,
        "k8s_namespace": NS,
        "kvbaton_namespace": "prod",
        "worker_flags": "--dtype float32 --kv-cache-gib 4",
    }
    return KubernetesOptions(**(options | overrides))


CASES = {
    "agg": KubernetesOptions(),
    "disagg": KubernetesOptions(mode="disagg", decode=2),
    "full": _full(),
}


def _by_name(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


@pytest.fixture
async def api_client() -> AsyncIterator[Any]:
    from kubernetes_asyncio import client

    async with client.ApiClient() as api:
        yield api


def _model(api: Any, obj: dict[str, Any]) -> Any:
    """The official client's model of `obj` (what it would make of an API server's answer)."""
    return api.deserialize(SimpleNamespace(data=json.dumps(obj)), MODEL_CLASS[obj["kind"]])


# -- the objects, through the Kubernetes client models


@pytest.mark.parametrize("case", sorted(CASES))
async def test_every_object_round_trips_through_its_client_model(
    api_client: Any, case: str
) -> None:
    objects = manifests(CASES[case])
    for obj in objects:
        model = _model(api_client, obj)
        assert type(model).__name__ == MODEL_CLASS[obj["kind"]]
        # The model keeps only the fields it knows (camelCase in, snake_case attributes):
        # equality after re-serialising means no field was misspelt, misplaced or dropped.
        assert api_client.sanitize_for_serialization(model) == obj, obj["metadata"]["name"]
    assert list(yaml.safe_load_all(to_yaml(objects))) == objects


def test_object_sets_in_apply_order() -> None:
    kinds_names = {
        case: [(o["kind"], o["metadata"]["name"]) for o in manifests(opts)]
        for case, opts in CASES.items()
    }
    common = [
        ("CustomResourceDefinition", "kvbatonleases.kvbaton.dev"),
        ("ServiceAccount", "kvbaton"),
        ("Role", "kvbaton"),
        ("RoleBinding", "kvbaton"),
    ]
    frontend = [("Service", "kvbaton-frontend"), ("Deployment", "kvbaton-frontend")]
    assert kinds_names["agg"] == [*common, *frontend, ("Deployment", "kvbaton-worker")]
    assert kinds_names["disagg"] == [
        *common,
        *frontend,
        ("Deployment", "kvbaton-prefill"),
        ("Deployment", "kvbaton-decode"),
    ]
    assert kinds_names["full"] == [
        *common,
        ("ServiceAccount", "kvbaton-planner"),
        ("Role", "kvbaton-planner"),
        ("RoleBinding", "kvbaton-planner"),
        ("Service", "kvbaton-etcd"),
        ("StatefulSet", "kvbaton-etcd"),
        ("Service", "kvbaton-nats"),
        ("Deployment", "kvbaton-nats"),
        *frontend,
        ("Deployment", "kvbaton-prefill"),
        ("Deployment", "kvbaton-decode"),
        ("ConfigMap", "kvbaton-planner-profile"),
        ("Deployment", "kvbaton-planner"),
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_labels_namespaces_and_selectors(case: str) -> None:
    components = {"frontend", "prefill", "decode", "worker", "planner", "etcd", "nats"}
    for obj in manifests(CASES[case]):
        meta = obj["metadata"]
        assert meta["labels"].items() >= LABELS.items(), meta["name"]
        component = meta["labels"]["app.kubernetes.io/component"]
        assert component in {*components, "discovery"}
        if obj["kind"] == "CustomResourceDefinition":
            assert "namespace" not in meta
            continue
        assert meta["namespace"] == CASES[case].k8s_namespace
        assert re.fullmatch(r"kvbaton(-[a-z0-9-]*[a-z0-9])?", meta["name"]), "not DNS-1035"
        selector = obj["spec"]["selector"] if obj["kind"] == "Service" else None
        if obj["kind"] in ("Deployment", "StatefulSet"):
            selector = obj["spec"]["selector"]["matchLabels"]
            assert obj["spec"]["template"]["metadata"]["labels"].items() >= selector.items()
        if selector is not None:
            assert selector["app.kubernetes.io/component"] == component
            assert selector["app.kubernetes.io/instance"] == "kvbaton"


async def test_disagg_workers_frontend_and_env_in_the_models(api_client: Any) -> None:
    options = _full()
    models = {key: _model(api_client, obj) for key, obj in _by_name(manifests(options)).items()}
    decode = models["Deployment", "kvbaton-decode"]
    prefill = models["Deployment", "kvbaton-prefill"]
    assert (prefill.spec.replicas, decode.spec.replicas) == (2, 3)
    pod = decode.spec.template.spec
    assert pod.service_account_name == "kvbaton"
    assert pod.termination_grace_period_seconds == 40
    (worker,) = pod.containers
    assert worker.image == "kvbaton:latest"
    assert worker.image_pull_policy == "IfNotPresent"
    assert worker.command == [
        *("kvbaton", "worker", "--role", "decode", "--model", "smollm2"),
        *("--namespace", "prod", "--drain-timeout", "30", "--device", "cuda"),
        *("--dtype", "float32", "--kv-cache-gib", "4"),
    ]
    assert prefill.spec.template.spec.containers[0].command[2:4] == ["--role", "prefill"]
    assert (worker.readiness_probe.http_get.path, worker.readiness_probe.http_get.port) == (
        "/health",
        9090,
    )
    assert worker.readiness_probe.period_seconds == 5
    assert worker.readiness_probe.failure_threshold == 3
    assert worker.startup_probe.http_get.path == "/health"  # ready: the model is loaded
    assert worker.startup_probe.failure_threshold * worker.startup_probe.period_seconds == 300
    assert worker.liveness_probe.http_get.path == "/live"
    assert worker.ports[0].container_port == 9090 and worker.ports[0].name == "system"
    assert worker.resources.limits == {"nvidia.com/gpu": "2"}

    env = {e.name: e for e in worker.env}
    assert env["POD_NAME"].value_from.field_ref.field_path == "metadata.name"
    assert env["POD_NAMESPACE"].value_from.field_ref.field_path == "metadata.namespace"
    assert env["POD_UID"].value_from.field_ref.field_path == "metadata.uid"
    assert env["KVBATON_HOST"].value_from.field_ref.field_path == "status.podIP"
    assert env["KVBATON_DISCOVERY"].value == "etcd://kvbaton-etcd:2379"
    assert env["KVBATON_EVENT_PLANE"].value == "nats://kvbaton-nats:4222"
    assert env["KVBATON_SYSTEM_PORT"].value == "9090"

    front = models["Deployment", "kvbaton-frontend"].spec.template.spec.containers[0]
    assert front.command == [
        *("kvbaton", "frontend", "--http-host", "0.0.0.0", "--http-port", "8000"),
        *("--namespace", "prod"),
    ]
    assert front.readiness_probe.http_get.path == "/health"
    assert front.liveness_probe.http_get.path == "/live"
    assert front.readiness_probe.http_get.port == front.liveness_probe.http_get.port == 8000
    assert "KVBATON_SYSTEM_PORT" not in {e.name for e in front.env}
    service = models["Service", "kvbaton-frontend"]
    assert service.spec.type == "ClusterIP"
    assert [(p.name, p.port, p.target_port) for p in service.spec.ports] == [("http", 8000, "http")]
    assert models["Service", "kvbaton-etcd"].spec.cluster_ip == "None"
    etcd = models["StatefulSet", "kvbaton-etcd"].spec
    assert etcd.service_name == "kvbaton-etcd"
    assert etcd.template.spec.containers[0].image == "quay.io/coreos/etcd:v3.5.17"
    assert models["Deployment", "kvbaton-nats"].spec.template.spec.containers[0].image == (
        "nats:2.10-alpine"
    )


async def test_defaults_cpu_discovery_on_the_api_server(api_client: Any) -> None:
    objects = _by_name(manifests(KubernetesOptions()))
    agg = _model(api_client, objects["Deployment", "kvbaton-worker"])
    assert agg.spec.replicas == 1
    (worker,) = agg.spec.template.spec.containers
    assert worker.command[:6] == ["kvbaton", "worker", "--role", "agg", "--model", "smollm2"]
    assert "--device" not in worker.command
    assert worker.resources.limits is None
    assert worker.resources.requests == {"cpu": "1", "memory": "2Gi"}
    env = {e.name: e.value for e in worker.env}
    assert env["KVBATON_DISCOVERY"] == "kubernetes"
    assert "KVBATON_EVENT_PLANE" not in env
    assert objects["Service", "kvbaton-frontend"]["metadata"]["namespace"] == "default"


async def test_rbac_and_planner_in_the_models(api_client: Any) -> None:
    objects = _by_name(manifests(_full()))
    models = {key: _model(api_client, obj) for key, obj in objects.items()}

    def verbs(role: Any) -> dict[tuple[str, str], list[str]]:
        return {(r.api_groups[0], r.resources[0]): r.verbs for r in role.rules}

    lease_verbs = ["get", "list", "watch", "create", "patch", "delete"]
    assert verbs(models["Role", "kvbaton"]) == {
        ("kvbaton.dev", "kvbatonleases"): lease_verbs,
        ("", "pods"): ["get", "list", "watch"],
    }
    assert verbs(models["Role", "kvbaton-planner"]) == {
        ("kvbaton.dev", "kvbatonleases"): lease_verbs,
        ("", "pods"): ["get", "list", "watch"],
        ("apps", "deployments"): ["get", "patch"],
    }
    for name in ("kvbaton", "kvbaton-planner"):
        binding = models["RoleBinding", name]
        assert (binding.role_ref.kind, binding.role_ref.name) == ("Role", name)
        assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [
            ("ServiceAccount", name, NS)
        ]
        assert models["ServiceAccount", name].metadata.namespace == NS

    planner = models["Deployment", "kvbaton-planner"]
    assert planner.spec.replicas == 1 and planner.spec.strategy.type == "Recreate"
    pod = planner.spec.template.spec
    assert pod.service_account_name == "kvbaton-planner"
    (container,) = pod.containers
    flags = dict(zip(container.command[2::2], container.command[3::2], strict=True))
    assert container.command[:2] == ["kvbaton", "planner"]
    assert flags == {
        "--frontend": "http://kvbaton-frontend:8000",
        "--namespace": "prod",
        "--profile": "/etc/kvbaton/profile.json",
        "--ttft-ms": "500",
        "--itl-ms": "40",
        "--connector": "kubernetes",
        "--k8s-namespace": NS,
        "--prefill-deployment": "kvbaton-prefill",
        "--decode-deployment": "kvbaton-decode",
        "--min-prefill": "1",
        "--max-prefill": "8",
        "--min-decode": "1",
        "--max-decode": "6",
    }
    assert ("Deployment", flags["--prefill-deployment"]) in objects
    assert ("Deployment", flags["--decode-deployment"]) in objects
    assert "--k8s-host" not in container.command  # in-cluster service account
    # The planner's own parser accepts the command, and reads the file mounted from the map.
    from kvbaton.cli.main import build_parser

    args = build_parser().parse_args(container.command[1:])
    assert (args.connector, args.decode_deployment, args.max_decode) == (
        "kubernetes",
        "kvbaton-decode",
        6,
    )
    (mount,) = container.volume_mounts
    assert Path(mount.mount_path) / "profile.json" == args.profile
    (volume,) = pod.volumes
    assert mount.name == volume.name
    config_map = models["ConfigMap", volume.config_map.name]
    assert Profile.from_json(config_map.data["profile.json"].encode()) == Profile.from_json(PROFILE)
    assert "KVBATON_SYSTEM_PORT" not in {e.name for e in container.env}


def test_the_worker_and_frontend_commands_parse_with_kvbaton_s_own_parser() -> None:
    from kvbaton.cli.main import build_parser

    objects = _by_name(manifests(_full()))
    for name in ("kvbaton-frontend", "kvbaton-prefill", "kvbaton-decode"):
        (container,) = objects["Deployment", name]["spec"]["template"]["spec"]["containers"]
        args = build_parser().parse_args(container["command"][1:])
        assert args.namespace == "prod"
    decode = objects["Deployment", "kvbaton-decode"]["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(decode[0]["command"][1:])
    assert (args.role, args.device, args.drain_timeout, args.dtype) == (
        "decode",
        "cuda",
        30.0,
        "float32",
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"workers": -1}, "--workers must be 0 or more"),
        ({"mode": "disagg", "prefill": -1}, "--prefill must be 0 or more"),
        ({"mode": "disagg", "decode": -2}, "--decode must be 0 or more"),
        ({"gpus_per_worker": -1}, "--gpus-per-worker must be 0 or more"),
        ({"mode": "both"}, "--mode must be agg or disagg"),
        ({"with_planner": True, "planner_profile": "{}"}, "--with-planner needs --mode disagg"),
        ({"mode": "disagg", "with_planner": True}, "needs --planner-profile"),
        ({"planner_profile": PROFILE.decode()}, "without --with-planner"),
        ({"name": "Bad_Name"}, "not a DNS-1035 label"),
        ({"name": "1kvbaton"}, "not a DNS-1035 label"),
        ({"name": "kvbaton-"}, "not a DNS-1035 label"),
        ({"name": "k" * 48}, "longer than 47"),
        ({"k8s_namespace": "Prod"}, "not a Kubernetes namespace name"),
        ({"kvbaton_namespace": "a.b"}, "invalid kvbaton namespace"),
        ({"kvbaton_namespace": "ns_"}, "must be a Kubernetes label value"),
        ({"image": ""}, "not an image reference"),
        ({"model": " "}, "--model must not be empty"),
        ({"worker_flags": "--role prefill"}, "must not hold --role"),
        ({"worker_flags": "--namespace=x"}, "must not hold --namespace"),
        ({"worker_flags": "--drain-timeout 60"}, "must not hold --drain-timeout"),
        ({"worker_flags": "--system-port=9000"}, "must not hold --system-port"),
        ({"worker_flags": "--dtype 'float32"}, "--worker-flags"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        KubernetesOptions(**options)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"planner_profile": '{"engine": 1}'}, "is not a profile written by `kvbaton profile`"),
        (
            {
                "planner_profile": Profile(engine="torch", model="m", prefill=PROFILE_POINTS)
                .to_json()
                .decode()
            },
            "--planner-profile has no decode curve",
        ),
        ({"ttft_ms": None}, "needs --ttft-ms above 0"),
        ({"itl_ms": 0.0}, "needs --itl-ms above 0"),
        ({"min_prefill": 3, "max_prefill": 2}, "need 0 <= --min-prefill <= --max-prefill"),
        ({"min_decode": 0}, "--min-decode must be 1 or more"),
    ],
)
def test_bad_planner_options_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _full(**overrides)


def test_the_longest_name_still_fits() -> None:
    for obj in manifests(_full(name="k" * 47)):
        assert len(obj["metadata"]["name"]) <= 63


# -- applied to kmock's Kubernetes API; the planner's connector scales the decode Deployment


def _create_call(api: Any, obj: dict[str, Any], body: Any) -> Callable[[], Awaitable[Any]]:
    from kubernetes_asyncio import client

    ns = obj["metadata"].get("namespace")
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    rbac = client.RbacAuthorizationV1Api(api)
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "CustomResourceDefinition": lambda: client.ApiextensionsV1Api(
            api
        ).create_custom_resource_definition(body),
        "ServiceAccount": lambda: core.create_namespaced_service_account(ns, body),
        "Role": lambda: rbac.create_namespaced_role(ns, body),
        "RoleBinding": lambda: rbac.create_namespaced_role_binding(ns, body),
        "ConfigMap": lambda: core.create_namespaced_config_map(ns, body),
        "Service": lambda: core.create_namespaced_service(ns, body),
        "Deployment": lambda: apps.create_namespaced_deployment(ns, body),
        "StatefulSet": lambda: apps.create_namespaced_stateful_set(ns, body),
    }
    return calls[obj["kind"]]


async def test_applies_to_kmock_and_the_planner_scales_decode() -> None:
    kmock = pytest.importorskip("kmock", reason="kmock is in the test extra")
    from kubernetes_asyncio import client

    from kvbaton.planner.connectors import make_connector

    objects = manifests(_full(decode=1))
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        url = str(server.url)
        async with client.ApiClient(client.Configuration(host=url)) as api:
            for obj in objects:  # as typed models: what the client sends is what it modelled
                created = await _create_call(api, obj, _model(api, obj))()
                assert created.metadata.name == obj["metadata"]["name"]
            stored = {
                (o.raw["kind"], o.raw["metadata"]["name"]): o.raw for o in emulator.objects.values()
            }
            assert stored == _by_name(objects), "the API stored other objects than generated"

            apps = client.AppsV1Api(api)
            listed = await apps.list_namespaced_deployment(NS)
            assert sorted(d.metadata.name for d in listed.items) == [
                "kvbaton-decode",
                "kvbaton-frontend",
                "kvbaton-nats",
                "kvbaton-planner",
                "kvbaton-prefill",
            ]
            crds = await client.ApiextensionsV1Api(api).list_custom_resource_definition()
            assert [c.spec.names.short_names for c in crds.items] == [["kvl"]]
            role = await client.RbacAuthorizationV1Api(api).read_namespaced_role(
                "kvbaton-planner", NS
            )
            assert any("deployments" in r.resources for r in role.rules)

            # The planner's connector, configured as the planner's command line says.
            planner = _by_name(objects)["Deployment", "kvbaton-planner"]
            command = planner["spec"]["template"]["spec"]["containers"][0]["command"]
            flag = dict(zip(command[2::2], command[3::2], strict=True))
            connector = make_connector(
                "kubernetes",
                namespace=flag["--k8s-namespace"],
                deployments={
                    "prefill": flag["--prefill-deployment"],
                    "decode": flag["--decode-deployment"],
                },
                host=url,
            )
            try:
                assert await connector.current() == {"prefill": 2, "decode": 1}
                await connector.scale("decode", 3)
                assert await connector.current() == {"prefill": 2, "decode": 3}
            finally:
                await connector.close()
            decode = await apps.read_namespaced_deployment("kvbaton-decode", NS)
            assert decode.spec.replicas == 3
            prefill = await apps.read_namespaced_deployment("kvbaton-prefill", NS)
            assert prefill.spec.replicas == 2
        raw = emulator.objects["apps/v1/deployments", NS, "kvbaton-decode"].raw
        assert raw["spec"]["replicas"] == 3
        # Nothing else of the Deployment changed.
        expected = _by_name(objects)["Deployment", "kvbaton-decode"]
        assert {**raw, "spec": {**raw["spec"], "replicas": 1}} == expected


# -- the command line


def _kvbaton(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbaton", "deploy", "kubernetes", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def test_cli_prints_yaml_for_kubectl() -> None:
    done = _kvbaton("--mode", "disagg", "--prefill", "2", "--worker-flags=--dtype=float32")
    assert done.returncode == 0, done.stderr
    objects = list(yaml.safe_load_all(done.stdout))
    expected = KubernetesOptions(mode="disagg", prefill=2, worker_flags="--dtype=float32")
    assert objects == manifests(expected)
    assert _by_name(objects)["Deployment", "kvbaton-prefill"]["spec"]["replicas"] == 2
    assert _by_name(objects)["Deployment", "kvbaton-decode"]["spec"]["replicas"] == 1


def test_cli_writes_one_file_per_object(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_bytes(PROFILE)
    out = tmp_path / "manifests"
    flags = ["--mode", "disagg", "--with-planner", "--planner-profile", str(profile)]
    flags += ["--ttft-ms", "500", "--itl-ms", "40", "--with-nats", "--name", "llm"]
    done = _kvbaton(*flags, "--output-dir", str(out), "--k8s-namespace", NS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(out)
    expected = manifests(
        KubernetesOptions(
            mode="disagg",
            with_planner=True,
            planner_profile=PROFILE.decode(),
            ttft_ms=500,
            itl_ms=40,
            with_nats=True,
            name="llm",
            k8s_namespace=NS,
        )
    )
    files = sorted(out.iterdir())
    assert [f.name for f in files] == [file_name(i, o) for i, o in enumerate(expected, start=1)]
    assert files[0].name == "01-customresourcedefinition-kvbatonleases.kvbaton.dev.yaml"
    assert files[-1].name == f"{len(expected):02d}-deployment-llm-planner.yaml"
    assert [yaml.safe_load(f.read_text()) for f in files] == expected

    again = _kvbaton("--output-dir", str(out))  # not empty any more
    assert again.returncode == 2
    assert "must be a new or empty directory" in again.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode", "disagg", "--prefill", "-1"], "--prefill must be 0 or more"),
        (["--workers", "-3"], "--workers must be 0 or more"),
        (["--with-planner"], "--with-planner needs --mode disagg"),
        (
            ["--mode", "disagg", "--with-planner", "--ttft-ms", "1", "--itl-ms", "1"],
            "needs --planner-profile",
        ),
        (["--name", "Bad_Name"], "not a DNS-1035 label"),
        (["--prefill", "2"], "--prefill and --decode are for --mode disagg"),
        (["--mode", "disagg", "--workers", "2"], "--workers is for --mode agg"),
        (
            ["--mode", "disagg", "--with-planner", "--planner-profile", "missing.json"],
            "cannot read --planner-profile missing.json",
        ),
    ],
)
def test_cli_refuses_bad_input_and_writes_nothing(
    tmp_path: Path, args: list[str], message: str
) -> None:
    out = tmp_path / "out"
    done = _kvbaton(*args, "--output-dir", str(out), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert done.stderr.startswith("kvbaton: error: ")
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    assert not out.exists()


# -- the Containerfile


def _readme_install_command() -> str:
    """The install command of the README's "Set up": its first code block, before `&&`."""
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1]
    block = setup.split("```", 2)[1]
    command = block.strip().splitlines()[0].split("&&")[0].strip()
    assert command.startswith("pip install"), command
    return command


def _run_steps() -> list[str]:
    text = (ROOT / "Containerfile").read_text().replace("\\\n", " ")
    return [line.strip()[4:].strip() for line in text.splitlines() if line.startswith("RUN ")]


def test_containerfile_installs_with_the_readme_s_command() -> None:
    steps = _run_steps()
    install = _readme_install_command()
    assert install in steps, f"no `RUN {install}` in the Containerfile: {steps}"
    torch_step = next(i for i, s in enumerate(steps) if "TORCH_INDEX" in s)
    assert torch_step < steps.index(install), "torch must come from its index first"
    assert steps.index(install) < steps.index("kvbaton pull"), "the model is baked in after"
    text = (ROOT / "Containerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.MULTILINE)
    assert re.search(r"^USER 1000", text, re.MULTILINE)
    # The workers' compiled decode (`--compile auto`) builds with a C++ compiler, into a
    # directory the image's user owns.
    assert any(s.startswith("apt-get update") and " g++ " in s for s in steps), steps
    joined = text.replace("\\\n", " ")
    assert re.search(r"^ENV .*\bKVBATON_COMPILED_DIR=\S+", joined, re.MULTILINE), joined
    user = text.index("\nUSER 1000")
    owned = [s for s in steps if s.startswith("useradd") and "chown" in s]
    assert owned and '"${KVBATON_COMPILED_DIR}"' in owned[0].split("chown", 1)[1], owned
    assert text.index("useradd") < user


def test_containerfile_torch_spec_is_pyproject_s() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (torch,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    match = re.search(r'^ARG TORCH_SPEC="(.+)"$', (ROOT / "Containerfile").read_text(), re.M)
    assert match and match.group(1) == torch
