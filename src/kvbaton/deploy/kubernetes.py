"""The Kubernetes objects of one kvbaton deployment, as plain dicts (`kvbaton deploy kubernetes`).

`manifests(options)` is pure: the same options give the same objects, in apply order:

1. the KvbatonLease CRD (cluster-scoped; what `--discovery kubernetes` writes),
2. ServiceAccount, Role and RoleBinding `{name}` (frontend and workers: leases, pods), and
   `{name}-planner` (the same, plus reading and scaling Deployments) with the planner,
3. etcd (headless Service + StatefulSet) and NATS (Service + Deployment), when asked for,
4. the frontend Service and Deployment, the worker Deployments (`{name}-worker` in agg mode,
   `{name}-prefill` and `{name}-decode` in disagg mode),
5. with the planner: its profile ConfigMap and its Deployment.

Invariants: every object carries the labels of `labels()`; every namespaced object has
`metadata.namespace` and a name that is a DNS-1035 label; every key is the API's camelCase
name and no value is None (so that an object equals its Kubernetes client model's
serialisation); no Namespace object is written (`kubectl create namespace` makes it).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from kvbaton.planner.types import Profile
from kvbaton.runtime.discovery import kube_objects
from kvbaton.runtime.names import check_name

Obj = dict[str, Any]

FRONTEND_PORT = 8000
SYSTEM_PORT = 9090  # a worker's /health, /live and /metrics (KVBATON_SYSTEM_PORT)
DRAIN_TIMEOUT_S = 30  # a stopped worker drains this long (the frontend migrates the rest)
GRACE_PERIOD_S = 40  # the pod's SIGTERM-to-SIGKILL time: the drain plus a margin
PROFILE_DIR = "/etc/kvbaton"
PROFILE_FILE = "profile.json"
ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
NATS_IMAGE = "nats:2.10-alpine"
ETCD_PORT = 2379
NATS_PORT = 4222
# Flags the manifests set themselves: in --worker-flags they would break the wiring (a longer
# --drain-timeout would outlast the pod's grace period).
RESERVED_WORKER_FLAGS = (
    "--role",
    "--namespace",
    "--model",
    "--discovery",
    "--host",
    "--drain-timeout",
    "--system-port",  # the probes' port
)
LONGEST_SUFFIX = "-planner-profile"  # of the object names derived from --name

_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


@dataclass(frozen=True, kw_only=True)
class KubernetesOptions:
    """What `kvbaton deploy kubernetes` deploys; construction raises ValueError on bad input,
    with a message that names the command's flag."""

    mode: Literal["agg", "disagg"] = "agg"
    model: str = "smollm2"  # the image bakes this one in
    workers: int = 1  # agg
    prefill: int = 1  # disagg
    decode: int = 1  # disagg
    gpus_per_worker: int = 0
    with_planner: bool = False
    planner_profile: str | None = None  # the JSON text of a `kvbaton profile` file
    ttft_ms: float | None = None
    itl_ms: float | None = None
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    with_etcd: bool = False
    with_nats: bool = False
    image: str = "kvbaton:latest"
    name: str = "kvbaton"
    k8s_namespace: str = "default"
    kvbaton_namespace: str = "kvbaton"
    worker_flags: str = ""

    def __post_init__(self) -> None:
        if self.mode not in ("agg", "disagg"):
            raise ValueError(f"--mode must be agg or disagg, not {self.mode!r}")
        for flag, count in (
            ("--workers", self.workers),
            ("--prefill", self.prefill),
            ("--decode", self.decode),
            ("--gpus-per-worker", self.gpus_per_worker),
        ):
            if count < 0:
                raise ValueError(f"{flag} must be 0 or more, not {count}")
        _check_name(self.name)
        if len(self.k8s_namespace) > 63 or not _DNS_1123.fullmatch(self.k8s_namespace):
            raise ValueError(
                f"--k8s-namespace {self.k8s_namespace!r} is not a Kubernetes namespace name "
                "(lower-case letters, digits and '-', at most 63)"
            )
        check_name("kvbaton namespace (--kvbaton-namespace)", self.kvbaton_namespace)
        if len(self.kvbaton_namespace) > 63 or not _LABEL_VALUE.fullmatch(self.kvbaton_namespace):
            raise ValueError(
                f"--kvbaton-namespace {self.kvbaton_namespace!r} must be a Kubernetes label "
                "value: at most 63 characters, starting and ending with a letter or digit"
            )
        if not self.model.strip():
            raise ValueError("--model must not be empty")
        if not self.image or any(c.isspace() for c in self.image):
            raise ValueError(f"--image {self.image!r} is not an image reference")
        self._check_worker_flags()
        if self.with_planner:
            self._check_planner()
        elif self.planner_profile is not None:
            raise ValueError("--planner-profile is given without --with-planner")

    def _check_worker_flags(self) -> None:
        try:
            flags = shlex.split(self.worker_flags)
        except ValueError as exc:
            raise ValueError(f"--worker-flags {self.worker_flags!r}: {exc}") from None
        for flag in flags:
            if flag.split("=", 1)[0] in RESERVED_WORKER_FLAGS:
                raise ValueError(
                    f"--worker-flags must not hold {flag.split('=', 1)[0]}: the manifests set "
                    f"it (reserved: {', '.join(RESERVED_WORKER_FLAGS)})"
                )

    def _check_planner(self) -> None:
        if self.mode != "disagg":
            raise ValueError("--with-planner needs --mode disagg (it scales prefill and decode)")
        if self.planner_profile is None:
            raise ValueError(
                "--with-planner needs --planner-profile FILE (made by `kvbaton profile`)"
            )
        try:
            profile = Profile.from_json(self.planner_profile.encode())
        except msgspec.DecodeError as exc:
            raise ValueError(
                f"--planner-profile is not a profile written by `kvbaton profile`: {exc}"
            ) from None
        for role, curve in (("prefill", profile.prefill), ("decode", profile.decode)):
            if not curve:
                raise ValueError(
                    f"--planner-profile has no {role} curve (`kvbaton profile --role {role}`)"
                )
        for flag, target in (("--ttft-ms", self.ttft_ms), ("--itl-ms", self.itl_ms)):
            if target is None or not target > 0:
                raise ValueError(f"--with-planner needs {flag} above 0 (a latency target)")
        for role, low, high in (
            ("prefill", self.min_prefill, self.max_prefill),
            ("decode", self.min_decode, self.max_decode),
        ):
            if not 0 <= low <= high:
                raise ValueError(f"need 0 <= --min-{role} <= --max-{role}, not {low} and {high}")
        if self.min_decode < 1:
            # The frontend's /health (its readiness) fails while no decode worker lives; the
            # planner reaches the frontend through its Service, so it could never scale up.
            raise ValueError("--min-decode must be 1 or more with --with-planner")

    @property
    def roles(self) -> dict[str, int]:
        """Worker role -> replicas (agg: one role, agg)."""
        if self.mode == "agg":
            return {"agg": self.workers}
        return {"prefill": self.prefill, "decode": self.decode}


def _check_name(name: str) -> None:
    limit = 63 - len(LONGEST_SUFFIX)
    if not _DNS_1035.fullmatch(name):
        raise ValueError(
            f"--name {name!r} is not a DNS-1035 label: lower-case letters, digits and '-', "
            "starting with a letter and ending with a letter or digit"
        )
    if len(name) > limit:
        raise ValueError(
            f"--name {name!r} is longer than {limit} characters "
            f"(the object {name}{LONGEST_SUFFIX} must fit in 63)"
        )


def read_profile(path: str) -> str:
    """The text of a profile file; ValueError, naming the file, when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --planner-profile {path}: {exc}") from None


# -- the objects


def labels(o: KubernetesOptions, component: str) -> dict[str, str]:
    """The labels of every object of the deployment (`instance` tells deployments apart)."""
    return {
        "app.kubernetes.io/name": "kvbaton",
        "app.kubernetes.io/instance": o.name,
        "app.kubernetes.io/part-of": "kvbaton",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": kube_objects.MANAGED_BY,
    }


def _meta(o: KubernetesOptions, name: str, component: str) -> Obj:
    return {"name": name, "namespace": o.k8s_namespace, "labels": labels(o, component)}


def _selector(o: KubernetesOptions, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/instance": o.name,
        "app.kubernetes.io/component": component,
    }


def _crd(o: KubernetesOptions) -> Obj:
    crd = kube_objects.crd_manifest()
    # Cluster-scoped and shared by every deployment: no `instance` label.
    shared = {k: v for k, v in labels(o, "discovery").items() if k != "app.kubernetes.io/instance"}
    crd["metadata"]["labels"] = {**shared, **crd["metadata"]["labels"]}
    return crd


def _rbac(o: KubernetesOptions, name: str, component: str, planner: bool) -> list[Obj]:
    rules: list[Obj] = [
        {
            "apiGroups": [kube_objects.GROUP],
            "resources": [kube_objects.PLURAL],
            "verbs": ["get", "list", "watch", "create", "patch", "delete"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    ]
    if planner:
        # The kubernetes connector reads and patches spec.replicas, nothing else.
        rules.append(
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "patch"]}
        )
    rbac = "rbac.authorization.k8s.io"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(o, name, component)},
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "Role",
            "metadata": _meta(o, name, component),
            "rules": rules,
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "RoleBinding",
            "metadata": _meta(o, name, component),
            "roleRef": {"apiGroup": rbac, "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": o.k8s_namespace}],
        },
    ]


def _env(o: KubernetesOptions, worker: bool) -> list[Obj]:
    def field(name: str, path: str) -> Obj:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    discovery = f"etcd://{o.name}-etcd:{ETCD_PORT}" if o.with_etcd else "kubernetes"
    env = [
        field("POD_NAME", "metadata.name"),
        field("POD_NAMESPACE", "metadata.namespace"),
        field("POD_UID", "metadata.uid"),
        field("KVBATON_HOST", "status.podIP"),  # the request plane binds and advertises it
        {"name": "KVBATON_DISCOVERY", "value": discovery},
    ]
    if worker:
        env.append({"name": "KVBATON_SYSTEM_PORT", "value": str(SYSTEM_PORT)})
    if o.with_nats:
        env.append({"name": "KVBATON_EVENT_PLANE", "value": f"nats://{o.name}-nats:{NATS_PORT}"})
    return env


def _probe(path: str, port: int, period: int, failures: int) -> Obj:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 3,  # (readiness decides routing: a busy moment is not a failure)
        "failureThreshold": failures,
    }


def _container(o: KubernetesOptions, name: str, command: list[str], worker: bool) -> Obj:
    return {
        "name": name,
        "image": o.image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "env": _env(o, worker),
    }


def _deployment(
    o: KubernetesOptions, name: str, component: str, replicas: int, pod: Obj, **spec: Any
) -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(o, name, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": _selector(o, component)},
            **spec,
            "template": {"metadata": {"labels": labels(o, component)}, "spec": pod},
        },
    }


def _service(o: KubernetesOptions, name: str, component: str, port: int, port_name: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(o, name, component),
        "spec": {
            "type": "ClusterIP",
            "selector": _selector(o, component),
            "ports": [{"name": port_name, "port": port, "targetPort": port_name}],
        },
    }


def _frontend(o: KubernetesOptions) -> list[Obj]:
    name = f"{o.name}-frontend"
    command = ["kvbaton", "frontend", "--http-host", "0.0.0.0", "--http-port", str(FRONTEND_PORT)]
    container = _container(o, "frontend", [*command, "--namespace", o.kvbaton_namespace], False)
    container |= {
        "ports": [{"name": "http", "containerPort": FRONTEND_PORT}],
        # /health answers 503 while the frontend sees no worker: no traffic until then.
        "readinessProbe": _probe("/health", FRONTEND_PORT, period=5, failures=3),
        "livenessProbe": _probe("/live", FRONTEND_PORT, period=10, failures=3),
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
    }
    pod = {"serviceAccountName": o.name, "containers": [container]}
    return [
        _service(o, name, "frontend", FRONTEND_PORT, "http"),
        _deployment(o, name, "frontend", 1, pod),
    ]


def _worker(o: KubernetesOptions, role: str, replicas: int) -> Obj:
    command = ["kvbaton", "worker", "--role", role, "--model", o.model]
    command += ["--namespace", o.kvbaton_namespace, "--drain-timeout", str(DRAIN_TIMEOUT_S)]
    resources: Obj = {"requests": {"cpu": "1", "memory": "2Gi"}}
    if o.gpus_per_worker > 0:
        command += ["--device", "cuda"]
        resources["limits"] = {"nvidia.com/gpu": str(o.gpus_per_worker)}
    command += shlex.split(o.worker_flags)
    container = _container(o, "worker", command, True)
    container |= {
        "ports": [{"name": "system", "containerPort": SYSTEM_PORT}],
        # A model load can be slow: up to 5 minutes before the liveness probe starts.
        # /live answers while the model loads; /health once the worker serves: a load that
        # hangs for 5 minutes gets the container restarted.
        "startupProbe": _probe("/health", SYSTEM_PORT, period=5, failures=60),
        "readinessProbe": _probe("/health", SYSTEM_PORT, period=5, failures=3),
        "livenessProbe": _probe("/live", SYSTEM_PORT, period=10, failures=3),
        "resources": resources,
    }
    pod = {
        "serviceAccountName": o.name,
        # SIGTERM: the worker deregisters and drains its streams (--drain-timeout) first.
        "terminationGracePeriodSeconds": GRACE_PERIOD_S,
        "containers": [container],
    }
    name = f"{o.name}-{'worker' if role == 'agg' else role}"
    return _deployment(o, name, "worker" if role == "agg" else role, replicas, pod)


def _planner(o: KubernetesOptions) -> list[Obj]:
    assert o.planner_profile is not None and o.ttft_ms is not None and o.itl_ms is not None
    name = f"{o.name}-planner"
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(o, f"{name}-profile", "planner"),
        "data": {PROFILE_FILE: o.planner_profile},
    }
    command = [
        *("kvbaton", "planner", "--frontend", f"http://{o.name}-frontend:{FRONTEND_PORT}"),
        *("--namespace", o.kvbaton_namespace, "--profile", f"{PROFILE_DIR}/{PROFILE_FILE}"),
        *("--ttft-ms", f"{o.ttft_ms:g}", "--itl-ms", f"{o.itl_ms:g}"),
        *("--connector", "kubernetes", "--k8s-namespace", o.k8s_namespace),
        *("--prefill-deployment", f"{o.name}-prefill", "--decode-deployment", f"{o.name}-decode"),
        *("--min-prefill", str(o.min_prefill), "--max-prefill", str(o.max_prefill)),
        *("--min-decode", str(o.min_decode), "--max-decode", str(o.max_decode)),
    ]
    container = _container(o, "planner", command, False)
    container |= {
        "volumeMounts": [{"name": "profile", "mountPath": PROFILE_DIR, "readOnly": True}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
    }
    pod = {
        "serviceAccountName": name,
        "containers": [container],
        "volumes": [{"name": "profile", "configMap": {"name": f"{name}-profile"}}],
    }
    # Recreate: never two planners scaling the same Deployments during a rollout.
    return [config_map, _deployment(o, name, "planner", 1, pod, strategy={"type": "Recreate"})]


def _etcd(o: KubernetesOptions) -> list[Obj]:
    name = f"{o.name}-etcd"
    command = [
        "etcd",
        "--data-dir=/var/lib/etcd",
        f"--listen-client-urls=http://0.0.0.0:{ETCD_PORT}",
        f"--advertise-client-urls=http://{name}:{ETCD_PORT}",
    ]
    container = {
        "name": "etcd",
        "image": ETCD_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "ports": [{"name": "client", "containerPort": ETCD_PORT}],
        "readinessProbe": _probe("/health", ETCD_PORT, period=5, failures=3),
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
    }
    service = _service(o, name, "etcd", ETCD_PORT, "client")
    service["spec"] = {k: v for k, v in service["spec"].items() if k != "type"}
    service["spec"]["clusterIP"] = "None"  # headless: the name resolves to the pod
    pod = {
        "containers": [container],
        # An emptyDir: a restarted etcd pod starts empty (every lease held there is lost).
        "volumes": [{"name": "data", "emptyDir": {}}],
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(o, name, "etcd"),
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": _selector(o, "etcd")},
            "template": {"metadata": {"labels": labels(o, "etcd")}, "spec": pod},
        },
    }
    return [service, statefulset]


def _nats(o: KubernetesOptions) -> list[Obj]:
    name = f"{o.name}-nats"
    container = {
        "name": "nats",
        "image": NATS_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "client", "containerPort": NATS_PORT}],
        "readinessProbe": {"tcpSocket": {"port": NATS_PORT}, "periodSeconds": 5},
    }
    return [
        _service(o, name, "nats", NATS_PORT, "client"),
        _deployment(o, name, "nats", 1, {"containers": [container]}),
    ]


def manifests(options: KubernetesOptions) -> list[Obj]:
    """Every object of the deployment, in apply order (see the module's docstring)."""
    o = options
    objects = [_crd(o), *_rbac(o, o.name, "discovery", planner=False)]
    if o.with_planner:
        objects += _rbac(o, f"{o.name}-planner", "planner", planner=True)
    if o.with_etcd:
        objects += _etcd(o)
    if o.with_nats:
        objects += _nats(o)
    objects += _frontend(o)
    objects += [_worker(o, role, replicas) for role, replicas in o.roles.items()]
    if o.with_planner:
        objects += _planner(o)
    return objects


def to_yaml(objects: list[Obj]) -> str:
    """One YAML document per object, in order (what `kubectl apply -f -` reads)."""
    import yaml  # here: every kvbaton command imports this module for `deploy`'s flags

    return yaml.safe_dump_all(objects, sort_keys=False)


def file_name(index: int, obj: Obj) -> str:
    """`NN-kind-name.yaml`: file names sort in apply order."""
    return f"{index:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
