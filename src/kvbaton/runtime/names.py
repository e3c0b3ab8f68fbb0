"""Endpoint names and the discovery keys built from them (docs/architecture.md)."""

from __future__ import annotations

import re
from typing import NamedTuple

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
SERVICES_ROOT = "/services/"


def check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(
            f"invalid {kind} name {name!r}: use letters, digits, '_' and '-' (not first)"
        )
    return name


class EndpointPath(NamedTuple):
    namespace: str
    component: str
    endpoint: str

    @classmethod
    def parse(cls, path: str) -> EndpointPath:
        """'ns.component.endpoint' -> EndpointPath; raises ValueError on any other shape."""
        parts = path.split(".")
        if len(parts) != 3:
            raise ValueError(f"endpoint path {path!r} must be 'namespace.component.endpoint'")
        ns, comp, ep = parts
        return cls(
            check_name("namespace", ns), check_name("component", comp), check_name("endpoint", ep)
        )

    def __str__(self) -> str:
        return f"{self.namespace}.{self.component}.{self.endpoint}"

    def key_prefix(self) -> str:
        return f"{SERVICES_ROOT}{self.namespace}/{self.component}/{self.endpoint}-"

    def key(self, instance_id: int) -> str:
        return f"{self.key_prefix()}{instance_id:x}"

    def instance_id_from_key(self, key: str) -> int | None:
        """The instance id a key of this endpoint names; None for a key of another endpoint
        that shares the prefix (e.g. endpoint 'gen-x' under prefix 'gen-')."""
        prefix = self.key_prefix()
        if not key.startswith(prefix):
            return None
        suffix = key[len(prefix) :]
        try:
            return int(suffix, 16)
        except ValueError:
            return None
