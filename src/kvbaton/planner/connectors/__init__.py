"""Connectors: how a planner's decision reaches the deployment.

A connector reports the replicas of each pool it manages (`current()`) and changes them
(`scale(role, replicas)`). Roles are the worker roles the planner plans for, "prefill" and
"decode" (any other name a connector is configured with, e.g. "agg", works the same way).

- `local` (local.py): `kvbaton worker` processes on this machine, started and stopped by PID;
  a stopped worker deregisters at once and drains its in-flight streams, so no request is lost.
- `kubernetes` (kubernetes.py): the `spec.replicas` of one apps/v1 Deployment per role.
- `dry-run`: logs what it would do and changes nothing, alone or wrapping either of the above.

Contract of every connector:
- `current()` counts replicas that are wanted: a worker asked to stop no longer counts, even
  while it drains; a Deployment counts its `spec.replicas`, not its ready pods.
- `scale()` is idempotent and returns once the change is requested or started (it does not wait
  for a new worker to serve, nor for a stopped one to finish draining); replicas below 0 are
  refused with ValueError, and so is a role the connector was not configured with (except a
  request for 0 replicas of it, which is already true). Failures raise ConnectorError, with a
  message that says what to fix; every wait a connector makes is bounded.
- `close()` releases what the connector holds (the local one stops the workers it started).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
NAMES = ("local", "kubernetes", "dry-run")


class ConnectorError(RuntimeError):
    """A scaling request that could not be read or applied (the message says why)."""


@runtime_checkable
class Connector(Protocol):
    async def current(self) -> dict[str, int]:
        """Replicas per role ("prefill", "decode", and any other role configured)."""
        ...

    async def scale(self, role: str, replicas: int) -> None:
        """Ask for `replicas` of `role` (idempotent; returns once requested or started)."""
        ...

    async def close(self) -> None: ...


def check_replicas(role: str, replicas: int, roles: Mapping[str, object]) -> bool:
    """Validate a scale request; False when it asks for 0 of a role that is not configured
    (nothing to do), True when the connector should act."""
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise TypeError(f"replicas must be an int, not {type(replicas).__name__}")
    if replicas < 0:
        raise ValueError(f"cannot scale {role} to {replicas} replicas (below 0)")
    if role not in roles:
        if replicas == 0:
            return False
        known = ", ".join(sorted(roles)) or "none"
        raise ValueError(f"no {role} workers are configured (roles: {known})")
    return True


class DryRunConnector:
    """Logs every scaling decision and changes nothing.

    With `inner`, `current()` reads the real replicas through it (reading changes nothing) and
    `close()` closes it; without, `current()` reports `initial` (0 per role by default).
    `requested` keeps the last replicas asked for per role, `calls` every request in order."""

    def __init__(self, inner: Connector | None = None, initial: Mapping[str, int] | None = None):
        self.inner = inner
        self.initial = {role: 0 for role in ROLES} | dict(initial or {})
        self.requested: dict[str, int] = {}
        self.calls: list[tuple[str, int]] = []

    async def current(self) -> dict[str, int]:
        if self.inner is not None:
            return await self.inner.current()
        return dict(self.initial)

    async def scale(self, role: str, replicas: int) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"cannot scale {role} to {replicas!r} replicas")
        now = (await self.current()).get(role, 0)
        target = type(self.inner).__name__ if self.inner is not None else "nothing"
        log.info(
            "dry run: would scale %s from %d to %d replicas (through %s); nothing changed",
            role,
            now,
            replicas,
            target,
        )
        self.requested[role] = replicas
        self.calls.append((role, replicas))

    async def close(self) -> None:
        if self.inner is not None:
            await self.inner.close()


def make_connector(name: str, *, dry_run: bool = False, **options: Any) -> Connector:
    """The connector called `name` ("local", "kubernetes" or "dry-run"), built with `options`
    (the keyword arguments of its class); with `dry_run`, wrapped in a DryRunConnector, so that
    it reads the deployment but never changes it."""
    connector: Connector
    if name == "local":
        from kvbaton.planner.connectors.local import LocalConnector

        connector = LocalConnector(**options)
    elif name in ("kubernetes", "k8s"):
        from kvbaton.planner.connectors.kubernetes import KubernetesConnector

        connector = KubernetesConnector(**options)
    elif name in ("dry-run", "none"):
        return DryRunConnector(None, **options)
    else:
        raise ValueError(f"unknown connector {name!r} (known: {', '.join(NAMES)})")
    return DryRunConnector(connector) if dry_run else connector


__all__ = [
    "NAMES",
    "ROLES",
    "Connector",
    "ConnectorError",
    "DryRunConnector",
    "make_connector",
]
