"""What a frontend keeps stays bounded: after many requests (some left mid-stream), on workers
that come and go (each with a new instance id, as `serve` restarts them), it holds nothing per
request and, per worker, only what it keeps of the live ones: no router counts, open streams or
shedding counts of requests that ended, no series of the router's metrics and no KV index slot
of workers that left. A mocker worker per generation and the model manager, in one process, on
mem discovery and the real request plane."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvbaton.frontend.models import ModelManager, ServedModel
from kvbaton.frontend.settings import CanarySettings
from kvbaton.mocker import MockerTiming, create_mocker_engine
from kvbaton.mocker.runner import mocker_config
from kvbaton.protocols.llm import PreprocessedRequest, SamplingParams
from kvbaton.router import RouterMetrics, RouterSettings
from kvbaton.router.kv_router import KvRouter
from kvbaton.runtime import DistributedRuntime
from kvbaton.workers.llm_worker import LLMWorker
from tests.helpers import routed_series, wait_until

pytestmark = pytest.mark.integration

WORKERS = 4  # one after the other
REQUESTS = 60  # per worker; every third is left after its first output


def _indexed_series(registry: CollectorRegistry) -> set[str]:
    return {
        sample.labels["worker"]
        for metric in registry.collect()
        if metric.name == "kvbaton_router_indexed_blocks"
        for sample in metric.samples
    }


async def _card_gone(manager: ModelManager, worker_id: int) -> None:
    def gone() -> bool:
        model = manager.get("m")
        return model is None or worker_id not in model.cards

    await wait_until(gone, 10.0, f"the card of worker {worker_id:x} gone")


async def _request(served: ServedModel, i: int) -> None:
    prompt = [100 + (i * 7 + j) % 200 for j in range(24)]
    request = PreprocessedRequest(
        model=served.name, token_ids=prompt, sampling=SamplingParams(max_tokens=6, ignore_eos=True)
    )
    outputs = served.generate(request, f"r{i}", [])
    try:
        async for _ in outputs:
            if i % 3 == 0:
                break  # the client left mid-stream
    finally:
        await outputs.aclose()


async def test_state_stays_bounded_over_requests_and_worker_restarts(chat_model: Path) -> None:
    url = f"mem://{uuid.uuid4().hex}"
    registry = CollectorRegistry()
    async with DistributedRuntime(url, lease_ttl=2.0) as frontend_rt:
        manager = ModelManager(
            frontend_rt,
            "t",
            RouterSettings(mode="kv", kv_events=False),  # the index the router keeps itself
            RouterMetrics(registry),
            canary=CanarySettings(period_s=0),
        )
        await manager.start()
        try:
            seen: list[int] = []
            for n in range(WORKERS):
                worker_rt = DistributedRuntime(url, lease_ttl=2.0)
                config = mocker_config(model=str(chat_model), num_kv_blocks=256, block_size=4)
                engine = await create_mocker_engine(config, MockerTiming(speedup_ratio=1000))
                worker = LLMWorker(worker_rt, engine, served_name="m", namespace="t")
                serving = asyncio.create_task(worker.serve())
                try:
                    await wait_until(
                        lambda: (
                            (m := manager.get("m")) is not None
                            and any(i not in seen for i in m.instance_ids())
                        ),
                        30.0,
                        f"worker {n} serving",
                    )
                    served = manager.get("m")
                    assert served is not None
                    (worker_id,) = served.instance_ids()
                    seen.append(worker_id)
                    await asyncio.gather(*(_request(served, i) for i in range(REQUESTS)))
                    assert routed_series(registry) == {f"{worker_id:x}"}
                finally:
                    await worker_rt.shutdown()
                    await asyncio.wait_for(serving, 10)
                await _card_gone(manager, worker_id)

            router = served.router
            assert isinstance(router, KvRouter)
            # Per request: nothing left.
            assert router.in_flight == {} and len(router.active) == 0
            assert frontend_rt.request_client.open_streams() == 0
            loads = served.loads
            assert loads is not None  # its next poll forgets the workers that left
            await wait_until(lambda: not loads._sent and not loads.loads, 10.0, "loads forgotten")
            # Per worker: none of the workers that left.
            assert routed_series(registry) == set()
            assert router.indexer.workers == [] and _indexed_series(registry) == set()
            assert router._leaving == set()
        finally:
            await manager.close()
