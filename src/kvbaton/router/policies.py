"""Routers: each ranks the live workers for a request, best first (the frontend tries them in
that order), and follows the requests it routed until they end.

A request's life with its router: `route()` ranks; `Route.start()` as it is sent, before any
await (requests routed at once must see each other), and `Route.start(w)` once worker w took
it (`Route.send` does both); `Route.first_token()`; `Route.done()` exactly once.
Every router counts in-flight requests per worker from these calls; the requests routed to a
worker (the metric) are those it took. A decode worker that receives the prompt's KV from a
prefill worker (`Route.sent_kv()`) has none of its prompt to prefill.

A worker that leaves (`Router.forget_worker`) is forgotten once its last request counted here
ends: its series of the metrics go, so that workers that come and go (restarts, scaling) do not
pile up label sets for the frontend's life.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbaton.protocols.llm import EngineOutput
from kvbaton.router.decisions import DecisionLog
from kvbaton.router.metrics import RouterMetrics

if TYPE_CHECKING:
    from kvbaton.runtime import ResponseStream


@dataclass
class RouteRequest:
    token_ids: Sequence[int]
    extra_keys: tuple[object, ...] | None = None  # LoRA, salt: blocks of others never match
    overlap_weight: float | None = None  # per-request overrides of the KV router's settings
    temperature: float | None = None


class Route:
    """One routed request. `ranking` is the order to try workers in; `overlaps` and `costs`,
    where the router knows them, each worker's leading blocks of the prompt already cached and
    its cost (the KV router's)."""

    def __init__(
        self,
        router: Router,
        request: RouteRequest,
        ranking: list[int],
        overlaps: dict[int, int] | None = None,
        costs: dict[int, float] | None = None,
    ) -> None:
        self.router = router
        self.request = request
        self.ranking = ranking
        self.overlaps = overlaps or {}
        self.costs = costs or {}
        self.worker_id: int | None = None  # where the request counts
        self._taken_by: int | None = None  # the last worker that took it
        self._done = False
        self.prefills = True  # the worker computes the KV of the prompt it lacks

    @property
    def taken_by(self) -> int | None:
        """The last worker that took the request (None: none yet)."""
        return self._taken_by

    def prefer(self, worker_id: int) -> bool:
        """Try `worker_id` first, the rest of the ranking after it, if it is ranked at all
        (call before `start`); whether it is."""
        if worker_id not in self.ranking:
            return False
        self.ranking = [worker_id, *(w for w in self.ranking if w != worker_id)]
        return True

    def sent_kv(self, sent: bool = True) -> None:
        """The worker is sent the prompt's KV by a prefill worker, or (False, the default)
        computes what it lacks. A request counted already is counted anew."""
        if sent == self.prefills:
            self.prefills = not sent
            if self.worker_id is not None and not self._done:
                self.router._recount(self)

    def start(self, worker_id: int | None = None) -> None:
        """Count the request on `worker_id`, which took it, from now on; None: on its
        first-ranked worker, before any took it (call before any await: requests routed at
        once must see each other)."""
        taker = worker_id
        if worker_id is None and self.ranking:
            worker_id = self.ranking[0]
        if worker_id is None or self._done:
            return
        if worker_id != self.worker_id:
            if self.worker_id is not None:
                self.router._release(self)
            self.worker_id = worker_id
            self.router._serve(self)
        if taker is not None and taker != self._taken_by:
            self._taken_by = taker
            self.router._taken(self)

    async def send(self, stream: ResponseStream) -> None:
        """Open `stream` (the request to the ranked workers), counted on the first-ranked
        worker before it awaits, then on the worker that took it."""
        self.start()
        await stream.open()
        assert stream.instance_id is not None
        self.start(stream.instance_id)

    def first_token(self) -> None:
        if self.worker_id is not None and not self._done:
            self.router._first_token(self)

    def done(self) -> None:
        if not self._done:
            self._done = True
            if self.worker_id is not None:
                self.router._release(self)


async def follow(
    stream: ResponseStream, route: Route, served_by: list[int]
) -> AsyncGenerator[EngineOutput, None]:
    """A worker's outputs, its route kept up to date (the worker that produced the first
    token, or a last output without one, goes to `served_by`); the route is done at the end.

    - Outputs that arrived together while the reader was busy come as one
      (`EngineOutput.merged`): under load, fewer deltas and SSE chunks of more tokens."""
    try:
        await route.send(stream)
        assert stream.instance_id is not None
        taken = False
        async for first in stream:
            for out in _merged_ready(first, stream):
                if not taken and (out.token_ids or out.is_last):
                    taken = True
                    route.start(stream.instance_id)  # a refusal may have passed it on
                    served_by.append(stream.instance_id)
                    route.first_token()
                yield out
    finally:
        route.done()
        await stream.aclose()


def _merged_ready(first: EngineOutput, stream: ResponseStream) -> list[EngineOutput]:
    """`first`, merged with the outputs that already arrived after it where they merge."""
    outs = [first]
    while stream.ready():
        later = stream.take()
        merged = outs[-1].merged(later)
        if merged is None:
            outs.append(later)
        else:
            outs[-1] = merged
    return outs


class Router:
    mode = "base"

    def __init__(
        self, model: str = "", metrics: RouterMetrics | None = None, component: str = ""
    ) -> None:
        """`component`: "namespace.component" of the workers routed to (a label of the
        metrics)."""
        self.model = model
        self.metrics = metrics
        self.component = component
        self.in_flight: dict[int, int] = {}
        self.decisions = DecisionLog()
        self._leaving: set[int] = set()  # forgotten once their requests here end
        self._rotation = itertools.count()

    async def start(self) -> None:
        """Begin following whatever the router needs (KV events)."""

    async def close(self) -> None:
        """Stop following it."""

    def route(self, request: RouteRequest, candidates: Sequence[int]) -> Route:
        """Rank `candidates` (live workers of the model) for `request`."""
        started = time.perf_counter()
        route = self._route(request, list(candidates))
        self._observe(started)
        return route

    def pin(self, request: RouteRequest, worker_id: int) -> Route:
        """Route to the worker the request names; it is followed like any other."""
        started = time.perf_counter()
        route = self._pin(request, worker_id)
        self._observe(started)
        return route

    def _observe(self, started: float) -> None:
        if self.metrics is not None:
            self.metrics.decision_seconds.labels(self.model, self.component, self.mode).observe(
                time.perf_counter() - started
            )

    def _route(self, request: RouteRequest, candidates: list[int]) -> Route:
        return Route(self, request, self.rank(candidates))

    def _pin(self, request: RouteRequest, worker_id: int) -> Route:
        return Route(self, request, [worker_id])

    def rank(self, candidates: list[int]) -> list[int]:
        raise NotImplementedError

    def forget_worker(self, worker_id: int) -> None:
        """`worker_id` left (its model card is gone): forget what is kept per worker, now, or
        once the requests counted on it here have ended."""
        if self.in_flight.get(worker_id):
            self._leaving.add(worker_id)
        else:
            self._forget(worker_id)

    def _forget(self, worker_id: int) -> None:
        self._leaving.discard(worker_id)
        if self.metrics is not None:
            self.metrics.forget_worker(self.model, self.component, self.mode, worker_id)

    def _rotated(self, candidates: list[int]) -> list[int]:
        if len(candidates) < 2:
            return candidates
        start = next(self._rotation) % len(candidates)
        return candidates[start:] + candidates[:start]

    # -- a routed request's life (called by Route) -------------------------------------------
    def _serve(self, route: Route) -> None:
        assert route.worker_id is not None
        self.in_flight[route.worker_id] = self.in_flight.get(route.worker_id, 0) + 1
        self._leaving.discard(route.worker_id)  # routed to again: its card came back

    def _recount(self, route: Route) -> None:
        """`route.prefills` changed while the route counted on `route.worker_id`."""

    def _taken(self, route: Route) -> None:
        assert route.worker_id is not None
        self.decisions.record(route.worker_id, route.ranking, route.overlaps, route.costs)
        if self.metrics is not None:
            labels = (self.model, self.component, self.mode, f"{route.worker_id:x}")
            self.metrics.routed.labels(*labels).inc()

    def _first_token(self, route: Route) -> None:
        pass

    def _release(self, route: Route) -> None:
        assert route.worker_id is not None
        left = self.in_flight[route.worker_id] - 1
        if left:
            self.in_flight[route.worker_id] = left
        else:
            del self.in_flight[route.worker_id]
            if route.worker_id in self._leaving:
                self._forget(route.worker_id)


class RoundRobinRouter(Router):
    mode = "round-robin"

    def rank(self, candidates: list[int]) -> list[int]:
        return self._rotated(candidates)


class RandomRouter(Router):
    mode = "random"

    def rank(self, candidates: list[int]) -> list[int]:
        return random.sample(candidates, len(candidates))


class LeastLoadedRouter(Router):
    """Fewest requests in flight (from this router) first; ties take turns."""

    mode = "least-loaded"

    def rank(self, candidates: list[int]) -> list[int]:
        return sorted(self._rotated(candidates), key=lambda w: self.in_flight.get(w, 0))


class PowerOfTwoRouter(Router):
    """Two workers drawn at random, the less loaded first; the rest after, at random."""

    mode = "power-of-two"

    def rank(self, candidates: list[int]) -> list[int]:
        order = random.sample(candidates, len(candidates))
        if len(order) > 1 and self.in_flight.get(order[1], 0) < self.in_flight.get(order[0], 0):
            order[0], order[1] = order[1], order[0]
        return order


class DirectRouter(Router):
    """Only the worker the request names (`nvext.backend_instance_id`); the frontend refuses
    a request that names none."""

    mode = "direct"

    def rank(self, candidates: list[int]) -> list[int]:
        raise ValueError("router mode 'direct' needs nvext.backend_instance_id in the request")
