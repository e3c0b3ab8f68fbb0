"""Routing (step S3): which worker serves a request. The KV-cache-aware router and the simple
policies, all behind `Router.route()`; `make_router` builds the one a frontend's settings ask
for."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbaton.protocols.llm import ModelCard
from kvbaton.router.cost import DEFAULT_OVERLAP_WEIGHT
from kvbaton.router.disagg import TRANSFER_ORDERS
from kvbaton.router.indexer import ApproxKvIndexer, KvIndexer, TierCredits
from kvbaton.router.kv_events import KvEventSubscriber
from kvbaton.router.kv_router import KvRouter
from kvbaton.router.metrics import RouterMetrics
from kvbaton.router.policies import (
    DirectRouter,
    LeastLoadedRouter,
    PowerOfTwoRouter,
    RandomRouter,
    RoundRobinRouter,
    Route,
    Router,
    RouteRequest,
)
from kvbaton.router.prefill_router import PrefillError, PrefillRouter
from kvbaton.router.replica_sync import ReplicaSync
from kvbaton.runtime import DistributedRuntime

ROUTER_MODES = ("round-robin", "random", "least-loaded", "power-of-two", "kv", "direct")
_SIMPLE: dict[str, type[Router]] = {
    "round-robin": RoundRobinRouter,
    "random": RandomRouter,
    "least-loaded": LeastLoadedRouter,
    "power-of-two": PowerOfTwoRouter,
    "direct": DirectRouter,
}


@dataclass(frozen=True)
class RouterSettings:
    """How a frontend routes. `mode` None: "kv" for a model whose workers publish KV events,
    else "least-loaded"."""

    mode: str | None = None
    kv_events: bool = True  # False: kv mode indexes the requests it routed (approximate)
    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT
    temperature: float = 0.0
    tier_credits: TierCredits = field(default_factory=TierCredits)
    approx_ttl_s: float = 120.0
    # Disaggregation (once prefill workers exist): refuse (503) rather than run a request
    # whole on a decode worker while none does; prefill on the decode worker when the part of
    # the prompt not cached there is shorter than this many tokens.
    enforce_disagg: bool = False
    max_local_prefill_tokens: int = 0
    transfer_order: str = "prefill-first"  # or "decode-first" (see disagg.py)

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in ROUTER_MODES:
            raise ValueError(f"router mode must be one of {', '.join(ROUTER_MODES)}")
        if self.overlap_weight < 0 or self.temperature < 0 or self.approx_ttl_s <= 0:
            raise ValueError("overlap weight and temperature must be >= 0, the TTL > 0")
        if self.max_local_prefill_tokens < 0:
            raise ValueError("max_local_prefill_tokens must be >= 0")
        if self.transfer_order not in TRANSFER_ORDERS:
            raise ValueError(f"transfer order must be one of {', '.join(TRANSFER_ORDERS)}")


def make_router(
    settings: RouterSettings,
    runtime: DistributedRuntime,
    card: ModelCard,
    metrics: RouterMetrics | None = None,
    sync: ReplicaSync | None = None,
) -> Router:
    """`sync`: a KV router counts the other frontends' requests too (replica_sync.py)."""
    mode = settings.mode or ("kv" if card.kv_events else "least-loaded")
    if mode != "kv":
        return _SIMPLE[mode](card.name, metrics, card.component)
    subscriber = None
    indexer: KvIndexer
    if settings.kv_events:
        indexer = KvIndexer()
        subscriber = KvEventSubscriber(runtime, card.component, indexer, {}, card.name)
    else:
        indexer = ApproxKvIndexer(settings.approx_ttl_s)
    return KvRouter(
        indexer,
        card.kv_block_size,
        model=card.name,
        metrics=metrics,
        overlap_weight=settings.overlap_weight,
        temperature=settings.temperature,
        subscriber=subscriber,
        component=card.component,
        tier_credits=settings.tier_credits,
        sync=sync,
    )


__all__ = [
    "DEFAULT_OVERLAP_WEIGHT",
    "ROUTER_MODES",
    "KvRouter",
    "PrefillError",
    "PrefillRouter",
    "ReplicaSync",
    "Route",
    "RouteRequest",
    "Router",
    "RouterMetrics",
    "RouterSettings",
    "make_router",
]
