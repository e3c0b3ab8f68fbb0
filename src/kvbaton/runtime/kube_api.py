"""Where the Kubernetes API is, and how to reach it: shared by `--discovery kubernetes` and the
planner's kubernetes connector.

The API is found, in order: `host` when given (a URL with no credentials, e.g. `kubectl proxy`'s
http://127.0.0.1:8001, or a test stand-in); the kubeconfig file(s) of `kubeconfig` or
$KUBECONFIG (`context` picks one); the pod's service account when running in a cluster;
~/.kube/config when it exists. Anything else is a `KubeConfigError` that says what to set.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from kubernetes_asyncio import client, config
from kubernetes_asyncio.config.config_exception import ConfigException

KUBE_DEFAULT_CONFIG = "~/.kube/config"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class KubeConfigError(RuntimeError):
    """No usable Kubernetes API configuration (the message says what to set)."""


async def api_configuration(
    host: str | None = None, kubeconfig: str | None = None, context: str | None = None
) -> client.Configuration:
    if host is not None:
        return client.Configuration(host=host.rstrip("/"))
    configuration = client.Configuration()
    path = kubeconfig_path(kubeconfig)
    if path is None:  # in a pod
        load: Callable[..., None] = config.load_incluster_config
        try:
            load(client_configuration=configuration)
        except ConfigException as exc:
            raise KubeConfigError(f"cannot load the in-cluster config: {exc}") from exc
        return configuration
    try:
        await config.load_kube_config(
            config_file=path,
            context=context,
            client_configuration=configuration,
            persist_config=False,
        )
    except (ConfigException, OSError, ValueError) as exc:
        raise KubeConfigError(f"cannot load the kubeconfig {path}: {exc}") from exc
    return configuration


def kubeconfig_path(given: str | None) -> str | None:
    """The kubeconfig file(s) to load, or None for the in-cluster config."""
    if given:
        return given
    if os.environ.get("KUBECONFIG"):
        return os.environ["KUBECONFIG"]
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None
    default = Path(KUBE_DEFAULT_CONFIG).expanduser()
    if default.exists():
        return str(default)
    raise KubeConfigError(
        "no Kubernetes API configured: set KUBECONFIG, run inside a cluster, "
        "or give the API server's URL"
    )


def own_namespace() -> str | None:
    """The namespace of this pod ($POD_NAMESPACE, else the service account's), None outside."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    except OSError:
        return None
