"""The Kubernetes objects of `--discovery kubernetes`: the KvbatonLease custom resource.

One KvbatonLease per discovery lease (a process that serves holds one), in the Kubernetes
namespace of the deployment, named `{pod or host}-{lease id:x}`. Its `spec.keys` maps each
discovery key the lease owns to its value (base64); `spec.renewTime` is rewritten every TTL/3
while the owner lives. In a pod, the object is owned by the pod (an ownerReference), so that the
garbage collector deletes it with the pod, and `spec.pod` names the pod, whose Ready condition
gates the keys: readers hide the keys of a pod that is not Ready.

Labels: `kvbaton.dev/namespace` and `kvbaton.dev/component` (when every endpoint key of the
lease agrees on them) and `endpoint.kvbaton.dev/<endpoint>: "true"` per served endpoint, so that
`kubectl get kvl -l endpoint.kvbaton.dev/generate` lists the instances of an endpoint.

This module needs no Kubernetes client: `kvbaton deploy kubernetes` writes `crd_manifest()`.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvbaton.runtime.names import SERVICES_ROOT

GROUP = "kvbaton.dev"
VERSION = "v1alpha1"
KIND = "KvbatonLease"
PLURAL = "kvbatonleases"
SINGULAR = "kvbatonlease"
SHORT_NAMES = ["kvl"]
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"

LABEL_NAMESPACE = f"{GROUP}/namespace"
LABEL_COMPONENT = f"{GROUP}/component"
LABEL_ENDPOINT_PREFIX = f"endpoint.{GROUP}/"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
MANAGED_BY = "kvbaton"


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition of KvbatonLease (apiextensions.k8s.io/v1)."""
    spec_schema = {
        "type": "object",
        "required": ["ttlSeconds", "renewTime"],
        "properties": {
            "holder": {"type": "string", "description": "host and pid of the owning process"},
            "pod": {"type": "string", "description": "the owning pod; its readiness gates keys"},
            "ttlSeconds": {"type": "number", "minimum": 0},
            "renewTime": {"type": "string", "format": "date-time"},
            "keys": {
                "type": "object",
                "description": "discovery key -> value (base64)",
                "additionalProperties": {"type": "string", "format": "byte"},
            },
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {LABEL_MANAGED: MANAGED_BY}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {"spec": spec_schema},
                        }
                    },
                    "additionalPrinterColumns": [
                        {"name": "Pod", "type": "string", "jsonPath": ".spec.pod"},
                        {"name": "TTL", "type": "number", "jsonPath": ".spec.ttlSeconds"},
                        {"name": "Renewed", "type": "date", "jsonPath": ".spec.renewTime"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                }
            ],
        },
    }


# -- lease objects -------------------------------------------------------------------------------

_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_NOT_DNS = re.compile(r"[^a-z0-9.-]+")


@dataclass(frozen=True)
class LeaseRecord:
    """A KvbatonLease as readers use it."""

    name: str
    keys: dict[str, bytes]
    pod: str  # "" outside a pod: no readiness gate
    ttl: float
    renew: str  # spec.renewTime as written
    renew_wall: float  # the same, in seconds since the epoch
    version: str = ""  # metadata.resourceVersion


def object_name(base: str, lease_id: int) -> str:
    """A DNS subdomain name: the pod's (or host's) name, lowercased, and the lease id."""
    stem = _NOT_DNS.sub("-", base.lower())[:200].strip(".-") or "kvbaton"
    return f"{stem}-{lease_id:x}"


def rfc3339(wall: float) -> str:
    moment = datetime.datetime.fromtimestamp(wall, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_rfc3339(text: str) -> float:
    """Seconds since the epoch; -inf for what is not a timestamp (an expired record)."""
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return -math.inf


def labels_for(keys: Iterable[str]) -> dict[str, str]:
    """The labels of a lease holding `keys` (those that are valid label values only)."""
    namespaces, components, endpoints = set(), set(), set()
    for key in keys:
        if not key.startswith(SERVICES_ROOT):
            continue
        parts = key[len(SERVICES_ROOT) :].split("/")
        if len(parts) != 3:
            continue
        namespaces.add(parts[0])
        components.add(parts[1])
        endpoints.add(parts[2].rpartition("-")[0])
    labels = {LABEL_MANAGED: MANAGED_BY}
    if len(namespaces) == 1:
        labels[LABEL_NAMESPACE] = namespaces.pop()
    if len(components) == 1:
        labels[LABEL_COMPONENT] = components.pop()
    for endpoint in endpoints:
        if endpoint:
            labels[LABEL_ENDPOINT_PREFIX + endpoint] = "true"
    return {k: v for k, v in labels.items() if _label_ok(k, v)}


def _label_ok(key: str, value: str) -> bool:
    name = key.rpartition("/")[2]
    return (
        bool(name)
        and len(name) <= 63
        and bool(_LABEL_VALUE.match(name))
        and bool(_LABEL_VALUE.match(value))
    )


def encode_keys(keys: Mapping[str, bytes | None]) -> dict[str, str | None]:
    """spec.keys as JSON (None stays None: a merge patch's deletion)."""
    return {k: None if v is None else base64.b64encode(v).decode() for k, v in keys.items()}


def lease_object(
    *,
    name: str,
    namespace: str,
    keys: Mapping[str, bytes],
    pod: str,
    pod_uid: str,
    holder: str,
    ttl: float,
    renew: str,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels_for(keys)}
    if pod and pod_uid:  # garbage-collected with its pod
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": pod_uid}
        ]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "holder": holder,
            "pod": pod,
            "ttlSeconds": ttl,
            "renewTime": renew,
            "keys": encode_keys(keys),
        },
    }


def parse_lease(obj: Any) -> LeaseRecord | None:
    """None for an object that is not a well-formed KvbatonLease (readers skip it)."""
    try:
        name = obj["metadata"]["name"]
        version = str(obj["metadata"].get("resourceVersion") or "")
        spec = obj["spec"]
        keys = {
            str(k): base64.b64decode(v, validate=True) for k, v in (spec.get("keys") or {}).items()
        }
        ttl = float(spec["ttlSeconds"])
        renew = str(spec["renewTime"])
        pod = str(spec.get("pod") or "")
    except (KeyError, TypeError, ValueError, AttributeError, binascii.Error):
        return None
    if not isinstance(name, str) or not ttl > 0:
        return None
    return LeaseRecord(name, keys, pod, ttl, renew, parse_rfc3339(renew), version)


def pod_ready(obj: Any) -> bool:
    """Ready: its Ready condition is True and it is not terminating."""
    try:
        if obj["metadata"].get("deletionTimestamp"):
            return False
        conditions = (obj.get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    except (KeyError, TypeError, AttributeError):
        return False
