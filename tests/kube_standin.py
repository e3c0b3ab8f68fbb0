"""A Kubernetes API stand-in for tests: kmock's in-memory emulator on a loopback port, knowing
the resources kvbaton uses (its KvbatonLease custom resource, pods, Deployments).

`python -m tests.kube_standin PORT` serves until SIGTERM; `declare(emulator)` readies an
in-process emulator the same way. kmock stores objects as plain JSON (merge patches, no
resourceVersions, no garbage collection): the tests check what kvbaton sends and reads."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

from kvbaton.runtime.discovery import kube_objects as ko

RESOURCES = {
    f"{ko.API_VERSION}/{ko.PLURAL}": ko.KIND,
    "v1/pods": "Pod",
    "v1/services": "Service",
    "v1/serviceaccounts": "ServiceAccount",
    "v1/configmaps": "ConfigMap",
    "apps/v1/deployments": "Deployment",
    "apps/v1/statefulsets": "StatefulSet",
}


def declare(emulator: Any) -> None:
    for resource, kind in RESOURCES.items():
        emulator.resources[resource].kind = kind
        emulator.resources[resource].namespaced = True


async def serve(port: int) -> None:
    import kmock

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator, port=port):
        declare(emulator)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
