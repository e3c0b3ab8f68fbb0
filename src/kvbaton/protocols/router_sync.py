"""What frontend replicas tell each other of the requests they routed (`router/replica_sync.py`):
the `router_sync` endpoint of each frontend answers a stream of `RouteEventBatch`es, the first
one every request its routers count at that moment."""

from __future__ import annotations

import enum

import msgspec


class RouteEventKind(enum.IntEnum):
    ADDED = 0  # routed to `worker`: its blocks active there, `prefill_tokens` pending
    PREFILLED = 1  # its first token came: nothing of it pending prefill any more
    FREED = 2  # it ended there


class RouteEvent(msgspec.Struct, array_like=True, kw_only=True):
    kind: RouteEventKind
    component: str  # "namespace.component" of the workers routed to
    model: str  # their model (workers of several models may share a component)
    key: int  # the request, unique among the frontend's
    worker: int = 0
    block_hashes: list[int] = msgspec.field(default_factory=list)
    prefill_tokens: int = 0


class RouteEventBatch(msgspec.Struct, kw_only=True):
    events: list[RouteEvent] = msgspec.field(default_factory=list)
