"""Records kept in discovery."""

from __future__ import annotations

from typing import Any

import msgspec


class Instance(msgspec.Struct, frozen=True, kw_only=True):
    """One served endpoint of one process, stored at `/services/{ns}/{component}/{endpoint}-{id:x}`.

    `instance_id` is the id of the lease that owns the key: when the lease goes, so does the key.
    """

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    address: str  # e.g. "tcp://127.0.0.1:40123"
    transport: str = "tcp"
    pid: int = 0
    hostname: str = ""
    registered_at: float = 0.0  # seconds since the epoch
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def path(self) -> str:
        return f"{self.namespace}.{self.component}.{self.endpoint}"

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes) -> Instance:
        return msgspec.json.decode(data, type=cls)
