"""The KV-cache-aware router: sends a request to the worker whose cache already holds most of
its prompt, weighed against the work each worker already has (see `cost.py`).

It learns what workers cache from their KV events (`KvEventSubscriber`), or, in approximate
mode, from the requests it routed itself (`ApproxKvIndexer`); what they are busy with from its
own count of the requests it routed (`ActiveSequences`), with those the other frontends routed
(`replica_sync.py`), and from the load workers report."""

from __future__ import annotations

import random

from kvbaton.llm.hashing import hash_blocks, reusable_blocks
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.router.active import ActiveSequences
from kvbaton.router.cost import DEFAULT_OVERLAP_WEIGHT, Candidate, kv_cost, rank
from kvbaton.router.indexer import ApproxKvIndexer, KvIndexer, TierCredits
from kvbaton.router.kv_events import KvEventSubscriber
from kvbaton.router.metrics import RouterMetrics
from kvbaton.router.policies import Route, Router, RouteRequest
from kvbaton.router.replica_sync import ReplicaSync


class KvRoute(Route):
    def __init__(
        self,
        router: Router,
        request: RouteRequest,
        ranking: list[int],
        block_hashes: list[int],
        overlaps: dict[int, int],
        costs: dict[int, float],
        key: int,
    ) -> None:
        """`key`: the request's among those the router tells the other frontends of."""
        super().__init__(router, request, ranking, overlaps, costs)
        self.block_hashes = block_hashes
        self.key = key


class KvRouter(Router):
    mode = "kv"

    def __init__(
        self,
        indexer: KvIndexer,
        block_size: int,
        *,
        model: str = "",
        metrics: RouterMetrics | None = None,
        overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
        temperature: float = 0.0,
        subscriber: KvEventSubscriber | None = None,
        seed: int | None = None,
        component: str = "",
        tier_credits: TierCredits | None = None,
        sync: ReplicaSync | None = None,
    ) -> None:
        """`subscriber`: the workers' KV events feeding `indexer` (and their loads);
        `tier_credits`: what a block below a worker's pool is worth (`TierCredits()`);
        `sync`: the other frontends' requests counted too, and this one's told them."""
        super().__init__(model, metrics, component)
        if overlap_weight < 0 or temperature < 0:
            raise ValueError("overlap_weight and temperature must be >= 0")
        self.indexer = indexer
        self.block_size = block_size
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self.tier_credits = tier_credits or TierCredits()
        self.subscriber = subscriber
        # worker id -> its last load report
        self.loads: dict[int, WorkerLoad] = subscriber.loads if subscriber else {}
        self.active = ActiveSequences()
        self.sync = sync
        self._publisher = sync.register((component, model), self.active) if sync else None
        self._rng = random.Random(seed)
        if isinstance(indexer, ApproxKvIndexer):
            self.mode = "kv-approx"

    async def start(self) -> None:
        if self.metrics is not None:
            self.metrics.watch_index(self.model, self.component, self.indexer)
        if self.subscriber is not None:
            await self.subscriber.start()

    async def close(self) -> None:
        if self.sync is not None:
            self.sync.unregister((self.component, self.model), self.active)
        if self.metrics is not None:
            self.metrics.watch_index(self.model, self.component, None)
        if self.subscriber is not None:
            await self.subscriber.close()

    def candidates(
        self, block_hashes: list[int], workers: list[int], reusable: int | None = None
    ) -> list[Candidate]:
        """Each worker's standing for a prompt whose full blocks hash to `block_hashes`: its
        overlap counts the first `reusable` of them at most (None: all)."""
        matches = self.indexer.find_matches(block_hashes[:reusable])
        credited: dict[int, float] = {}
        if self.indexer.has_tiers:
            credited = self.indexer.credited_overlaps(
                block_hashes[:reusable], workers, self.tier_credits
            )
        active = self.active
        out = []
        for w in workers:
            pending = active.prefill_tokens(w)
            blocks = active.active_blocks(w)
            load = self.loads.get(w)
            if load is not None:
                pending = max(pending, load.active_prefill_tokens)
                blocks = max(blocks, load.kv_blocks_used)
            out.append(
                Candidate(
                    worker_id=w,
                    overlap_blocks=matches.get(w, 0),
                    tier_blocks=max(0.0, credited.get(w, 0.0) - matches.get(w, 0)),
                    pending_prefill_tokens=pending,
                    active_blocks=blocks,
                    shared_blocks=active.shared_prefix_blocks(w, block_hashes),
                    tree_size=self.indexer.tree_size(w),
                )
            )
        return out

    def rank_blocks(
        self,
        block_hashes: list[int],
        num_tokens: int,
        workers: list[int],
        overlap_weight: float | None = None,
        temperature: float | None = None,
    ) -> tuple[list[int], dict[int, int], dict[int, float]]:
        """`workers` best first for a prompt of `num_tokens` tokens whose full blocks hash to
        `block_hashes`, each one's overlap in blocks (the blocks a prefix cache can give the
        prompt: `reusable_blocks`) and its cost (`overlap_weight`, `temperature` None: the
        router's settings)."""
        cands = self.candidates(block_hashes, workers, reusable_blocks(num_tokens, self.block_size))
        weight = self.overlap_weight if overlap_weight is None else overlap_weight
        costs = [kv_cost(c, num_tokens, self.block_size, weight) for c in cands]
        temperature = self.temperature if temperature is None else temperature
        ranking = rank(cands, costs, temperature, self._rng)
        overlaps = {c.worker_id: c.overlap_blocks for c in cands}
        return ranking, overlaps, {c.worker_id: cost for c, cost in zip(cands, costs, strict=True)}

    def _route(self, request: RouteRequest, candidates: list[int]) -> Route:
        hashes = hash_blocks(request.token_ids, self.block_size, request.extra_keys)
        ranking, overlaps, costs = self.rank_blocks(
            hashes,
            len(request.token_ids),
            self._rotated(candidates),
            request.overlap_weight,
            request.temperature,
        )
        key = self._publisher.key() if self._publisher else 0
        return KvRoute(self, request, ranking, hashes, overlaps, costs, key)

    def _pin(self, request: RouteRequest, worker_id: int) -> Route:
        return self._route(request, [worker_id])

    def _serve(self, route: Route) -> None:
        super()._serve(route)
        self._add_active(route)

    def _recount(self, route: Route) -> None:
        self._add_active(route)

    def _add_active(self, route: Route) -> None:
        """Count the route's blocks on its worker, and the prompt it lacks as pending prefill
        there unless a prefill worker sends it the KV."""
        assert isinstance(route, KvRoute) and route.worker_id is not None
        worker = route.worker_id
        uncached = 0
        if route.prefills:
            overlap = route.overlaps.get(worker, 0)
            uncached = max(0, len(route.request.token_ids) - overlap * self.block_size)
        self.active.add(route, worker, route.block_hashes, uncached)
        if self._publisher is not None:
            self._publisher.added(route.key, worker, route.block_hashes, uncached)

    def _taken(self, route: Route) -> None:
        super()._taken(route)
        if self.metrics is not None:
            assert route.worker_id is not None
            overlap = route.overlaps.get(route.worker_id, 0)
            labels = (self.model, self.component, self.mode)
            self.metrics.overlap_blocks.labels(*labels).observe(overlap)

    def _first_token(self, route: Route) -> None:
        self.active.prefill_done(route)
        if self._publisher is not None:
            assert isinstance(route, KvRoute)
            self._publisher.prefilled(route.key)
        self._report_is_stale(route)
        if isinstance(self.indexer, ApproxKvIndexer):  # that worker computed the prompt's KV
            assert isinstance(route, KvRoute) and route.worker_id is not None
            self.indexer.record_routed(route.worker_id, route.block_hashes)

    def _release(self, route: Route) -> None:
        super()._release(route)
        self.active.free(route)
        if self._publisher is not None:
            assert isinstance(route, KvRoute)
            self._publisher.freed(route.key)
        self._report_is_stale(route)

    def _forget(self, worker_id: int) -> None:
        super()._forget(worker_id)
        if self.subscriber is None and isinstance(self.indexer, ApproxKvIndexer):
            self.indexer.remove_worker(worker_id)  # (the subscriber does it for KV events)

    def _report_is_stale(self, route: Route) -> None:
        """Work of the worker just ended, which its last load report may still count: until the
        next report, this router's own count stands alone (a stale report would keep the
        worker looking busy, and cost cache hits)."""
        if route.worker_id is not None:
            self.loads.pop(route.worker_id, None)
