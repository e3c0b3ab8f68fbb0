"""A mocker worker and a KV event subscriber in one process (mem discovery, the real request
plane), shared by the KV event tests of both event planes."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from kvbaton.llm.hashing import hash_blocks
from kvbaton.mocker import MockerTiming, create_mocker_engine
from kvbaton.mocker.runner import mocker_config
from kvbaton.protocols.llm import EngineOutput, PreprocessedRequest, SamplingParams
from kvbaton.router.indexer import KvIndexer
from kvbaton.router.kv_events import KvEventSubscriber
from kvbaton.runtime import Client, DistributedRuntime
from kvbaton.workers.kv_publisher import KvEventPublisher
from kvbaton.workers.llm_worker import LLMWorker
from tests.helpers import collect

BLOCK = 4


@dataclass
class Setup:
    worker_rt: DistributedRuntime
    publisher: KvEventPublisher
    worker_id: int
    generate: Client
    indexer: KvIndexer
    subscriber: KvEventSubscriber

    async def run(self, prompt: list[int]) -> None:
        request = PreprocessedRequest(
            model="m", token_ids=prompt, sampling=SamplingParams(max_tokens=2)
        )
        await collect(self.generate.round_robin(request))

    def matches(self, prompt: list[int]) -> dict[int, int]:
        return self.indexer.find_matches(hash_blocks(prompt, BLOCK))


@contextlib.asynccontextmanager
async def kv_setup(
    mocker_model: Path, event_plane: str = "direct", model: str = "m"
) -> AsyncIterator[Setup]:
    """A mocker worker of model "m" and a (not yet started) subscriber on `event_plane` that
    follows the workers of `model`."""
    url = f"mem://{uuid.uuid4().hex}"
    worker_rt = DistributedRuntime(url, lease_ttl=2.0, event_plane=event_plane)
    router_rt = DistributedRuntime(url, lease_ttl=2.0, event_plane=event_plane)
    publisher = KvEventPublisher()
    config = mocker_config(model=str(mocker_model), num_kv_blocks=64, block_size=BLOCK)
    engine = await create_mocker_engine(
        config, MockerTiming(speedup_ratio=1000), publisher.on_event
    )
    worker = LLMWorker(worker_rt, engine, served_name="m", namespace="t", kv_events=publisher)
    serving = asyncio.create_task(worker.serve())
    generate = await router_rt.endpoint("t.backend.generate").client(response_type=EngineOutput)
    (worker_id,) = await generate.wait_for_instances(10)
    indexer = KvIndexer()
    subscriber = KvEventSubscriber(router_rt, "t.backend", indexer, {}, model)
    try:
        yield Setup(worker_rt, publisher, worker_id, generate, indexer, subscriber)
    finally:
        await subscriber.close()
        await router_rt.shutdown()
        await worker_rt.shutdown()
        await asyncio.wait_for(serving, 10)
