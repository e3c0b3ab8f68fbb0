"""Routers without a network: the simple policies, the Route lifecycle, and the KV router fed
by hand-made KV events (subscriber=None)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvbaton.llm.hashing import block_extra_keys, hash_blocks
from kvbaton.protocols.kv import BlockStored
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.router.indexer import ApproxKvIndexer, KvIndexer
from kvbaton.router.kv_router import KvRoute, KvRouter
from kvbaton.router.metrics import RouterMetrics
from kvbaton.router.policies import (
    DirectRouter,
    LeastLoadedRouter,
    PowerOfTwoRouter,
    RandomRouter,
    RoundRobinRouter,
    Router,
    RouteRequest,
)
from tests.helpers import routed_series

pytestmark = pytest.mark.unit
BS = 4
A, B, C, D = 0xA1, 0xB2, 0xC3, 0xD4
PROMPT = list(range(1000, 1032))  # 32 tokens: 8 blocks
REQ = RouteRequest(token_ids=PROMPT, extra_keys=None)
# One token past PROMPT's 8 blocks: a cache can give all 8 (the last token is computed).
PAST = [*PROMPT, 2000]
REQ_PAST = RouteRequest(token_ids=PAST, extra_keys=None)


# -- simple policies ------------------------------------------------------------------------


def test_round_robin_cycles() -> None:
    r = RoundRobinRouter()
    rankings = [r.route(REQ, [1, 2, 3]).ranking for _ in range(6)]
    assert rankings == [[1, 2, 3], [2, 3, 1], [3, 1, 2]] * 2


def test_random_ranks_every_candidate_once() -> None:
    r = RandomRouter()
    firsts = set()
    for _ in range(50):
        ranking = r.route(REQ, [1, 2, 3]).ranking
        assert sorted(ranking) == [1, 2, 3]
        firsts.add(ranking[0])
    assert firsts == {1, 2, 3}


def test_least_loaded_prefers_fewer_in_flight() -> None:
    r = LeastLoadedRouter()
    busy = [r.route(REQ, [1, 2, 3]) for _ in range(3)]
    busy[0].start(1)
    busy[1].start(1)
    busy[2].start(2)
    assert r.in_flight == {1: 2, 2: 1}
    assert r.route(REQ, [1, 2, 3]).ranking == [3, 2, 1]
    busy[0].done()
    busy[1].done()
    assert r.route(REQ, [1, 2, 3]).ranking[-1] == 2


def test_least_loaded_ties_take_turns() -> None:
    r = LeastLoadedRouter()
    firsts = [r.route(REQ, [1, 2, 3]).ranking[0] for _ in range(3)]
    assert sorted(firsts) == [1, 2, 3]


def test_power_of_two_returns_all_and_puts_the_less_loaded_of_two_first() -> None:
    """With two candidates both are drawn: the idle one always comes first."""
    r = PowerOfTwoRouter()
    for _ in range(3):
        r.route(REQ, [1]).start(1)
    for _ in range(30):
        assert r.route(REQ, [1, 2]).ranking == [2, 1]
        assert sorted(r.route(REQ, [1, 2, 3, 4]).ranking) == [1, 2, 3, 4]


def test_direct_refuses_to_rank_but_pins() -> None:
    r = DirectRouter()
    with pytest.raises(ValueError, match="backend_instance_id"):
        r.route(REQ, [1, 2])
    route = r.pin(REQ, 7)
    assert route.ranking == [7]
    route.start(7)
    assert r.in_flight == {7: 1}
    route.done()
    assert r.in_flight == {}


# -- the Route lifecycle --------------------------------------------------------------------


@pytest.mark.parametrize("router_type", [RoundRobinRouter, LeastLoadedRouter, RandomRouter])
def test_route_lifecycle_counts(router_type: type[Router]) -> None:
    """served_by twice to different workers moves the count; the same worker twice counts
    once; done() twice is harmless; nothing after done() counts."""
    r = router_type()
    route = r.route(REQ, [1, 2])
    assert r.in_flight == {}
    route.start(1)
    route.start(1)
    assert r.in_flight == {1: 1}
    route.start(2)
    assert r.in_flight == {2: 1}
    route.first_token()
    route.done()
    route.done()
    assert r.in_flight == {}
    route.start(1)
    route.first_token()
    assert r.in_flight == {}


async def test_send_counts_the_first_choice_at_once_then_the_worker_that_took_it() -> None:
    """While the stream opens, the request counts on the first-ranked worker; once opened, on
    the one that took it (the first was unreachable, say)."""
    r = RoundRobinRouter()
    route = r.route(REQ, [1, 2])
    first, other = route.ranking
    seen = []

    class Stream:
        instance_id: int | None = None

        async def open(self) -> Stream:
            seen.append(dict(r.in_flight))
            self.instance_id = other
            return self

    await route.send(Stream())  # type: ignore[arg-type]
    assert seen == [{first: 1}]
    assert r.in_flight == {other: 1}
    route.done()
    assert r.in_flight == {}


async def test_only_the_worker_that_took_a_request_counts_it_as_routed() -> None:
    """The metric of requests routed to each worker: the first choice, counted while the
    stream opened elsewhere, is not; nor the first choice of a request that never went."""
    registry = CollectorRegistry()
    r = KvRouter(KvIndexer(), BS, model="m", metrics=RouterMetrics(registry), subscriber=None)

    def routed(worker: int) -> float | None:
        labels = {"model": "m", "component": "", "mode": "kv", "worker": f"{worker:x}"}
        return registry.get_sample_value("kvbaton_router_requests_total", labels)

    route = r.route(REQ, [A, B])
    first, other = route.ranking

    class Stream:
        instance_id: int | None = None

        async def open(self) -> Stream:
            self.instance_id = other
            return self

    await route.send(Stream())  # type: ignore[arg-type]
    route.start(other)  # its first output: the same worker, counted once
    route.done()
    assert (routed(first), routed(other)) == (None, 1)
    assert (
        registry.get_sample_value(
            "kvbaton_router_overlap_blocks_count", {"model": "m", "component": "", "mode": "kv"}
        )
        == 1
    )

    never_sent = r.route(REQ, [A, B])
    never_sent.start()  # a prefill-first decode route whose prefill ended the request
    never_sent.done()
    assert (routed(first), routed(other)) == (None, 1)
    assert r.in_flight == {}


def test_prefer_puts_a_ranked_worker_first_and_taken_by_names_the_taker() -> None:
    route = LeastLoadedRouter().route(REQ, [1, 2, 3])
    assert route.ranking == [1, 2, 3]
    assert not route.prefer(9)  # not a candidate: the ranking stands
    assert route.prefer(3) and route.ranking == [3, 1, 2]  # the rest follow, as ranked
    assert route.taken_by is None
    route.start()  # counted on the first-ranked before any took it
    assert route.worker_id == 3 and route.taken_by is None
    route.start(1)  # a refusal passed it on
    assert route.taken_by == 1
    route.done()


def test_done_without_a_worker_is_harmless() -> None:
    r = RoundRobinRouter()
    route = r.route(REQ, [1])
    route.first_token()
    route.done()
    assert r.in_flight == {} and route.worker_id is None


def test_metrics_are_recorded_per_component() -> None:
    """A disaggregating frontend's two routers (prefill and decode workers) count apart."""
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    routers = [
        KvRouter(KvIndexer(), BS, model="m", metrics=metrics, component="ns.prefill"),
        KvRouter(KvIndexer(), BS, model="m", metrics=metrics, component="ns.backend"),
    ]
    for r in routers:
        route = r.route(REQ, [A, B])
        route.start(A)
        route.done()
    routers[1].route(REQ, [A, B]).start(B)
    simple = RoundRobinRouter("m", metrics, "ns.other")
    simple.route(REQ, [C]).start(C)

    def sample(name: str, component: str, mode: str = "kv", **worker: str) -> float | None:
        labels = {"model": "m", "component": component, "mode": mode, **worker}
        return registry.get_sample_value(f"kvbaton_router_{name}", labels)

    assert sample("decision_seconds_count", "ns.prefill") == 1
    assert sample("decision_seconds_count", "ns.backend") == 2
    assert sample("overlap_blocks_count", "ns.prefill") == 1
    assert sample("overlap_blocks_count", "ns.backend") == 2
    assert sample("requests_total", "ns.prefill", worker=f"{A:x}") == 1
    assert sample("requests_total", "ns.prefill", worker=f"{B:x}") is None
    assert sample("requests_total", "ns.backend", worker=f"{A:x}") == 1
    assert sample("requests_total", "ns.backend", worker=f"{B:x}") == 1
    assert sample("requests_total", "ns.other", "round-robin", worker=f"{C:x}") == 1


@pytest.mark.parametrize("make", [RoundRobinRouter, KvRouter])
def test_workers_that_left_leave_no_state_behind(make: type[Router]) -> None:
    """Workers come and go (restarts, scaling), each with a new id: after many of them, the
    router keeps metrics' series and index slots for the live workers only. One that leaves
    with a request in flight keeps its series until that request ends."""
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    if make is KvRouter:
        r: Router = KvRouter(ApproxKvIndexer(), BS, model="m", metrics=metrics, subscriber=None)
    else:
        r = RoundRobinRouter("m", metrics)
    live = 0x1000
    for n in range(1, 201):
        newcomer = 0x1000 + n
        for worker in (live, newcomer):
            route = r.route(REQ, [worker])
            route.start(worker)
            route.first_token()
            route.done()
        in_flight = r.route(REQ, [live])
        in_flight.start(live)
        in_flight.first_token()
        r.forget_worker(live)  # it left while serving `in_flight`
        assert routed_series(registry) == {f"{live:x}", f"{newcomer:x}"}
        in_flight.done()
        assert routed_series(registry) == {f"{newcomer:x}"}
        live = newcomer
    assert r.in_flight == {} and r._leaving == set()
    if isinstance(r, KvRouter):
        assert r.indexer.workers == [live]
        assert len(r.active) == 0
    r.forget_worker(live)
    assert routed_series(registry) == set()
    r.forget_worker(0xDEAD)  # never routed to: harmless


def test_a_worker_routed_to_again_is_not_forgotten() -> None:
    """A worker whose card went while it served a request, and came back (routed to again)
    before that request ended, keeps its series."""
    registry = CollectorRegistry()
    r = RoundRobinRouter("m", RouterMetrics(registry))
    first = r.route(REQ, [A])
    first.start(A)
    r.forget_worker(A)
    again = r.route(REQ, [A])
    again.start(A)
    first.done()
    again.done()
    assert routed_series(registry) == {f"{A:x}"} and r._leaving == set()


# -- the KV router --------------------------------------------------------------------------


def stored(tokens: list[int], blocks: int, extra: tuple[object, ...] | None = None) -> BlockStored:
    """The KV event of a worker caching the first `blocks` blocks of `tokens`."""
    return BlockStored(
        event_id=0,
        block_hashes=hash_blocks(tokens, BS, extra)[:blocks],
        parent_hash=None,
        token_ids=tokens[: blocks * BS],
        block_size=BS,
    )


def kv_router(overlap_weight: float = 1.0, temperature: float = 0.0) -> KvRouter:
    return KvRouter(
        KvIndexer(),
        BS,
        overlap_weight=overlap_weight,
        temperature=temperature,
        subscriber=None,
        seed=0,
    )


def load(worker: int, *, prefill: int = 0, used: int = 0) -> WorkerLoad:
    return WorkerLoad(
        instance_id=worker,
        waiting=0,
        running=0,
        kv_blocks_total=100,
        kv_blocks_used=used,
        kv_blocks_free=100 - used,
        prefix_cache_hit_rate=0.0,
        active_prefill_tokens=prefill,
    )


def test_kv_router_picks_the_longest_cached_prefix() -> None:
    r = kv_router()
    r.indexer.apply(A, stored(PROMPT, 2))
    r.indexer.apply(B, stored(PROMPT, 6))
    r.indexer.apply(C, stored([7, *PROMPT[1:]], 8))  # same tail, different first token
    route = r.route(REQ, [A, B, C, D])
    assert isinstance(route, KvRoute)
    assert route.ranking[0] == B and route.ranking[1] == A
    assert route.overlaps == {A: 2, B: 6, C: 0, D: 0}
    assert route.block_hashes == hash_blocks(PROMPT, BS)


def test_kv_router_never_picks_a_removed_worker() -> None:
    r = kv_router()
    r.indexer.apply(A, stored(PROMPT, 8))
    r.indexer.apply(B, stored(PROMPT, 1))
    r.indexer.remove_worker(A)
    for _ in range(5):
        route = r.route(REQ, [B, C])
        assert A not in route.ranking and route.ranking[0] == B
        assert isinstance(route, KvRoute) and A not in route.overlaps
    assert A not in r.indexer.find_matches(hash_blocks(PROMPT, BS))


def test_kv_router_identical_requests_spread_by_pending_prefill() -> None:
    """A caches 2 of 8 blocks: the first request costs 6+8 on A, 8+8 on B. Routed to A, A has
    24 tokens (6 blocks) pending and 9 active blocks: the same request then costs 12+9 on A,
    still 16 on B, so it goes to B."""
    r = kv_router()
    r.indexer.apply(A, stored(PROMPT, 2))
    first = r.route(REQ, [A, B])
    assert first.ranking == [A, B]
    first.start(A)
    assert r.active.prefill_tokens(A) == 24 and r.active.active_blocks(A) == 9
    second = r.route(REQ, [A, B])
    assert second.ranking == [B, A]


def test_kv_router_burst_on_a_cold_pool_spreads_over_all_workers() -> None:
    r = kv_router()
    routes = []
    for _ in range(4):
        route = r.route(REQ, [A, B, C, D])
        route.start(route.ranking[0])
        routes.append(route)
    assert sorted(rt.worker_id or 0 for rt in routes) == [A, B, C, D]
    assert r.in_flight == dict.fromkeys([A, B, C, D], 1)


def test_kv_router_a_full_hit_beats_load_unless_the_weight_is_small() -> None:
    """A caches all 8 blocks of a 33-token prompt. After one request there (1 token of prefill
    pending), the same request costs w*(1+1)/4 + 9 active + 9 - 8 shared = 0.5w + 10 on A
    versus w*33/4 + 9 on idle B: A at w=1, B at w=0.1."""
    r = kv_router()
    r.indexer.apply(A, stored(PROMPT, 8))
    r.route(REQ_PAST, [A, B]).start(A)
    assert r.active.prefill_tokens(A) == 1
    assert r.route(REQ_PAST, [A, B]).ranking[0] == A
    low = RouteRequest(token_ids=PAST, extra_keys=None, overlap_weight=0.1)
    assert r.route(low, [A, B]).ranking[0] == B


def test_kv_router_counts_no_overlap_in_the_block_of_the_last_token() -> None:
    """A cache holding all of a prompt gives it all but the block of its last token, which is
    computed to sample from (kvbaton's engine and vLLM alike): the predicted overlap says so."""
    r = kv_router()
    r.indexer.apply(A, stored(PROMPT, 8))
    exact, past = r.route(REQ, [A]), r.route(REQ_PAST, [A])
    assert exact.overlaps == {A: 7} and past.overlaps == {A: 8}
    exact.start(A)
    assert r.active.prefill_tokens(A) == BS


def test_kv_router_first_token_and_done_drain_the_counts() -> None:
    r = kv_router()
    r.indexer.apply(A, stored(PROMPT, 2))
    routes = [r.route(REQ, [A]) for _ in range(3)]
    for route in routes:
        route.start(A)
    assert r.active.prefill_tokens(A) == 3 * 24
    assert r.active.active_blocks(A) == 8 + 3
    routes[0].first_token()
    assert r.active.prefill_tokens(A) == 2 * 24
    for route in routes[1:]:
        route.first_token()
    assert r.active.prefill_tokens(A) == 0
    assert r.active.active_blocks(A) == 11
    for route in routes:
        route.done()
        route.done()
    assert len(r.active) == 0 and r.in_flight == {}
    assert (r.active.prefill_tokens(A), r.active.active_blocks(A), r.active.requests(A)) == (
        0,
        0,
        0,
    )


def test_kv_router_a_worker_sent_the_kv_has_no_prefill_pending() -> None:
    """A caches 2 of 8 blocks. A request whose KV a prefill worker sends A holds 9 blocks there
    and leaves no prefill pending: the same request then costs 6 + 9 + 8 - 8 shared = 15 on A,
    16 on B. Once A computes the prompt itself (a failed prefill), 24 tokens are pending on A:
    12 + 9 = 21, and B is cheaper."""
    r = kv_router()
    r.indexer.apply(A, stored(PROMPT, 2))
    route = r.route(REQ, [A, B])
    route.sent_kv()
    route.start(A)
    assert (r.active.prefill_tokens(A), r.active.active_blocks(A)) == (0, 9)
    assert r.route(REQ, [A, B]).ranking[0] == A
    route.sent_kv(False)
    assert (r.active.prefill_tokens(A), r.active.active_blocks(A)) == (24, 9)
    assert r.active.requests(A) == 1 and r.in_flight == {A: 1}
    assert r.route(REQ, [A, B]).ranking[0] == B
    route.done()
    route.sent_kv()
    assert len(r.active) == 0 and r.in_flight == {}


def test_kv_router_served_by_another_worker_moves_the_active_request() -> None:
    r = kv_router()
    route = r.route(REQ, [A, B])
    route.start(A)
    route.start(B)
    assert r.in_flight == {B: 1}
    assert r.active.requests(A) == 0 and r.active.active_blocks(A) == 0
    assert r.active.prefill_tokens(B) == 32 and r.active.requests(B) == 1
    route.done()
    assert len(r.active) == 0 and r.in_flight == {}


def test_kv_router_reported_load_counts() -> None:
    """A worker's own load report (more than the router's count) weighs in: a full cache hit
    on A loses to idle B when A reports 20 blocks in use (cost 28 vs 16)."""
    r = kv_router()
    r.indexer.apply(A, stored(PROMPT, 8))
    assert r.route(REQ, [A, B]).ranking[0] == A
    r.loads[A] = load(A, used=20)
    assert r.route(REQ, [A, B]).ranking[0] == B
    r.loads[A] = load(A, prefill=400)  # 100 blocks pending at weight 1
    assert r.route(REQ, [A, B]).ranking[0] == B


def test_kv_router_per_request_overlap_weight() -> None:
    """Same state as above (A: full hit, 20 active blocks): weight 1 picks B, weight 10 A."""
    r = kv_router()
    r.indexer.apply(A, stored(PROMPT, 8))
    r.loads[A] = load(A, used=20)
    assert r.route(REQ, [A, B]).ranking[0] == B
    heavy = RouteRequest(token_ids=PROMPT, extra_keys=None, overlap_weight=10.0)
    assert r.route(heavy, [A, B]).ranking[0] == A
    assert r.route(REQ, [A, B]).ranking[0] == B  # the override did not stick


def test_kv_router_extra_keys_never_match_other_blocks() -> None:
    """Blocks stored without a salt, or with another, do not serve a request with one."""
    salt0 = block_extra_keys(cache_salt="s0")
    salted = block_extra_keys(cache_salt="s1")
    r = kv_router()
    r.indexer.apply(A, stored(PROMPT, 8))
    r.indexer.apply(B, stored(PROMPT, 8, salt0))
    with_salt0 = r.route(RouteRequest(token_ids=PAST, extra_keys=salt0), [A, B, C])
    plain = r.route(REQ_PAST, [A, B, C])
    other = r.route(RouteRequest(token_ids=PAST, extra_keys=salted), [A, B, C])
    assert isinstance(with_salt0, KvRoute) and isinstance(plain, KvRoute)
    assert isinstance(other, KvRoute)
    assert with_salt0.overlaps == {A: 0, B: 8, C: 0} and with_salt0.ranking[0] == B
    assert plain.overlaps == {A: 8, B: 0, C: 0} and plain.ranking[0] == A
    assert other.overlaps == {A: 0, B: 0, C: 0}


def test_kv_router_pin_follows_the_named_worker() -> None:
    r = kv_router()
    r.indexer.apply(A, stored(PROMPT, 8))
    route = r.pin(REQ, B)
    assert route.ranking == [B]
    route.start(B)
    assert r.active.prefill_tokens(B) == 32
    route.done()
    assert len(r.active) == 0


def test_kv_router_temperature_still_ranks_every_worker() -> None:
    r = kv_router(temperature=1.0)
    r.indexer.apply(A, stored(PROMPT, 8))
    firsts = []
    for _ in range(200):
        ranking = r.route(REQ, [A, B, C]).ranking
        assert sorted(ranking) == sorted([A, B, C])
        firsts.append(ranking[0])
    assert max(set(firsts), key=firsts.count) == A


def test_kv_router_rejects_negative_settings() -> None:
    with pytest.raises(ValueError):
        KvRouter(KvIndexer(), BS, overlap_weight=-1.0)
    with pytest.raises(ValueError):
        KvRouter(KvIndexer(), BS, temperature=-0.5)


def test_kv_router_approx_mode_learns_from_its_own_routes() -> None:
    """Without events, the blocks of a served request count as cached at that worker for
    ttl_s: the same prompt goes back there, and not after the TTL."""
    now = [0.0]
    r = KvRouter(ApproxKvIndexer(ttl_s=60.0, clock=lambda: now[0]), BS, subscriber=None)
    assert r.mode == "kv-approx"
    first = r.route(REQ_PAST, [A, B, C])
    worker = first.ranking[0]
    first.start(worker)
    first.first_token()
    first.done()
    for _ in range(3):
        route = r.route(REQ_PAST, [A, B, C])
        assert isinstance(route, KvRoute) and route.overlaps[worker] == 8
        assert route.ranking[0] == worker
    now[0] += 61.0
    route = r.route(REQ_PAST, [A, B, C])
    assert isinstance(route, KvRoute) and route.overlaps == dict.fromkeys([A, B, C], 0)


def test_kv_router_approx_mode_forgets_a_worker_that_passed_the_request_on() -> None:
    """A refused the request and B served it: only B computed the prompt's KV, so only B may
    count as caching it."""
    r = KvRouter(ApproxKvIndexer(ttl_s=60.0, clock=lambda: 0.0), BS, subscriber=None)
    route = r.route(REQ_PAST, [A, B])
    route.start(A)
    route.start(B)  # A refused; the request was passed on
    route.first_token()
    route.done()
    again = r.route(REQ_PAST, [A, B])
    assert isinstance(again, KvRoute)
    assert again.overlaps == {A: 0, B: 8}
    assert again.ranking[0] == B
