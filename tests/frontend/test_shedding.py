"""Load shedding's decisions, on loads set by hand: which workers are busy, the 503 when all
are, and thresholds changed at run time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from kvbaton.frontend.app import Frontend
from kvbaton.frontend.errors import OpenAIError
from kvbaton.frontend.settings import BusyThresholds
from kvbaton.frontend.shedding import FRESH_S, STALE_S, LoadMonitor, admit
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import DistributedRuntime

pytestmark = pytest.mark.unit


def load(worker: int, used: int, prefill: int) -> WorkerLoad:
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


def monitor(*loads: WorkerLoad) -> LoadMonitor:
    """A monitor whose workers have just answered with `loads`."""
    m = LoadMonitor(DistributedRuntime.__new__(DistributedRuntime), "t.backend")
    m.loads = {x.instance_id: x for x in loads}
    m._at = dict.fromkeys(m.loads, time.monotonic())
    return m


def test_busy_by_kv_usage_or_waiting_prefill_tokens() -> None:
    limits = BusyThresholds(kv_usage=0.9, prefill_tokens=1000)
    m = monitor(load(1, 89, 999), load(2, 90, 0), load(3, 0, 1000))
    assert [w for w in (1, 2, 3, 4) if m.busy(w, limits)] == [2, 3]  # 4: unknown, not busy
    m.sent(1, 1)  # what was sent since its last load counts at once
    assert m.busy(1, limits)
    assert admit(m, limits, [1, 2, 3, 4], "worker") == [4]
    off = BusyThresholds(kv_usage=None, prefill_tokens=None)
    assert admit(m, off, [3, 2, 1], "worker") == [3, 2, 1]
    assert admit(None, limits, [1, 2], "worker") == [1, 2]  # no monitor: no shedding
    m._at[2] -= STALE_S + 1  # no answer for a while: its last load says nothing
    assert not m.busy(2, limits)


def test_a_prompt_counts_as_waiting_until_prefilled_or_the_next_load() -> None:
    limits = BusyThresholds(kv_usage=None, prefill_tokens=1000)
    m = monitor(load(1, 0, 500))
    first = m.sent(1, 300)
    second = m.sent(1, 300)
    assert m.busy(1, limits)  # 500 + 600 waiting
    first()
    first()  # once only
    assert not m.busy(1, limits)  # 800
    third = m.sent(1, 300)
    assert m.busy(1, limits)
    m.answered(1, load(1, 0, 900))  # it counts what still waits
    second()  # sent before that load: already out of the count, not taken off again
    third()
    assert m.busy(1, limits) is False and m._sent.get(1, 0) == 0
    assert m.busy(1, BusyThresholds(kv_usage=None, prefill_tokens=900))


def test_every_worker_busy_is_a_503_with_retry_after() -> None:
    limits = BusyThresholds(kv_usage=0.5, retry_after_s=3)
    m = monitor(load(1, 60, 0), load(2, 99, 0))
    with pytest.raises(OpenAIError, match="every worker of model `m` is busy") as info:
        admit(m, limits, [1, 2], "worker of model `m`")
    assert info.value.status == 503
    assert info.value.headers == {"retry-after": "3"}
    assert info.value.code == "overloaded"


def test_thresholds_change_all_or_nothing() -> None:
    limits = BusyThresholds()
    limits.update(kv_usage=0.5, prefill_tokens=None)
    assert (limits.kv_usage, limits.prefill_tokens) == (0.5, None)
    for bad, match in (
        ({"kv_usage": 1.5}, "kv_usage"),
        ({"kv_usage": "high"}, "kv_usage"),
        ({"prefill_tokens": 0}, "prefill_tokens"),
        ({"prefill_tokens": 2.5}, "prefill_tokens"),
        ({"retry_after_s": -1}, "retry_after_s"),
        ({"kv_usage": 0.7, "bogus": 1}, "bogus"),
    ):
        with pytest.raises(ValueError, match=match):
            limits.update(**bad)
        assert (limits.kv_usage, limits.prefill_tokens) == (0.5, None)  # unchanged
    with pytest.raises(ValueError, match="kv_usage"):
        BusyThresholds(kv_usage=0)


def test_working_takes_a_fresh_load_with_requests() -> None:
    """What spares a busy worker its canary: a load under FRESH_S old with work in it."""
    busy, idle = load(1, 10, 0), load(2, 0, 0)
    busy.running = 2
    m = monitor(busy, idle)
    now = m._at[1]
    assert m.working(1) and not m.working(2) and not m.working(3)
    m._at[1] = now - FRESH_S - 1  # a worker that stopped answering: its old load says nothing
    assert not m.working(1)


async def test_thresholds_are_changed_from_the_frontends_machine_only() -> None:
    models = SimpleNamespace(thresholds=BusyThresholds(), models={})
    app = Frontend(models).app  # type: ignore[arg-type]
    for client, status in ((("10.1.2.3", 5000), 403), (("127.0.0.1", 5000), 200)):
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            r = await http.post("/busy_threshold", json={"kv_usage": 0.5})
            assert r.status_code == status, r.text
            assert (await http.get("/busy_threshold")).status_code == 200
    assert models.thresholds.kv_usage == 0.5  # changed once, from loopback


class LoadsClient:
    """A load_metrics client of workers 1, 2 and 3: each answers its load (5 blocks used)."""

    def __init__(self) -> None:
        self.asked: set[int] = set()

    def instance_ids(self) -> list[int]:
        return [1, 2, 3]

    async def direct(self, request: Any, worker: int, **_: Any) -> AsyncIterator[WorkerLoad]:
        self.asked.add(worker)
        yield load(worker, 5, 0)


async def test_a_monitor_asks_and_keeps_only_its_members() -> None:
    """Workers of another model share the component: the monitor of a model follows its own."""
    m = LoadMonitor(DistributedRuntime.__new__(DistributedRuntime), "t.backend", lambda: {1, 3})
    client = LoadsClient()
    m._client = client  # type: ignore[assignment]
    both = asyncio.Event()

    def answered(worker: int, worker_load: WorkerLoad) -> None:
        LoadMonitor.answered(m, worker, worker_load)
        if set(m.loads) >= {1, 3}:
            both.set()

    m.answered = answered  # type: ignore[method-assign]
    polling = asyncio.create_task(m._poll())
    try:
        async with asyncio.timeout(10):
            await both.wait()  # one poll asked every live worker it follows
    finally:
        polling.cancel()
        await asyncio.gather(polling, return_exceptions=True)
    assert client.asked == {1, 3} and set(m.loads) == {1, 3}
