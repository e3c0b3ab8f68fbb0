"""A routed request counts on its worker from the moment it is sent, not from the worker's first
answer (a prefill worker's answer comes once the whole prompt is computed): a burst of requests
routed at once spreads over the workers instead of piling onto the one that looked idlest when
they arrived. Both ways a frontend sends a request: the PrefillRouter's, and `follow` (a whole
request, or a decode worker's part)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from kvbaton.protocols.llm import EngineOutput, PreprocessedRequest
from kvbaton.router.disagg import follow
from kvbaton.router.indexer import KvIndexer
from kvbaton.router.kv_router import KvRouter
from kvbaton.router.policies import RouteRequest
from kvbaton.router.prefill_router import PrefillRouter
from kvbaton.runtime import Context, DistributedRuntime
from tests.helpers import collect, wait_until

ENDPOINT = "ns.prefill.generate"
BLOCK = 16


@pytest.mark.parametrize("path", ["prefill router", "follow"])
async def test_a_burst_spreads_over_the_workers(path: str) -> None:
    discovery = f"mem://{uuid.uuid4().hex}"
    answer = asyncio.Event()
    taken: dict[int, int] = {}  # worker -> prompts it has taken

    def worker(runtime: DistributedRuntime) -> object:
        async def generate(request: PreprocessedRequest, ctx: Context) -> AsyncIterator[object]:
            assert runtime.instance_id is not None
            taken[runtime.instance_id] = taken.get(runtime.instance_id, 0) + 1
            await answer.wait()  # prefilling
            yield EngineOutput(request_id=ctx.id, token_ids=[1])

        return generate

    burst: list[asyncio.Task[list[int]]] = []
    workers = [DistributedRuntime(discovery) for _ in range(2)]
    caller = DistributedRuntime(discovery)
    serving = [
        asyncio.create_task(
            w.endpoint(ENDPOINT).serve_endpoint(worker(w), request_type=PreprocessedRequest)
        )
        for w in workers
    ]
    try:
        client = await caller.endpoint(ENDPOINT).client(response_type=EngineOutput)
        await wait_until(lambda: len(client.instance_ids()) == 2, what="both prefill workers")
        indexer = KvIndexer()
        busy, idle = client.instance_ids()
        indexer.store(busy, [12345])  # it caches a block: ties go to the other one
        router = KvRouter(indexer, BLOCK)
        prefill = PrefillRouter(caller, client, router)

        async def send(i: int) -> list[int]:
            prompt = [i * 1000 + t for t in range(4 * BLOCK)]
            request = PreprocessedRequest(model="m", token_ids=prompt)
            hints, candidates = RouteRequest(prompt), client.instance_ids()
            if path == "prefill router":
                out = await prefill.prefill(request, f"r{i}", hints, candidates, [])
                return out.token_ids
            route = router.route(hints, candidates)
            outs = await collect(follow(client.ordered(request, route.ranking), route, []))
            return [t for out in outs for t in out.token_ids]

        burst += [asyncio.create_task(send(i)) for i in range(6)]
        await wait_until(lambda: sum(taken.values()) == 6, what="every request taken")
        assert taken == {busy: 3, idle: 3}
        answer.set()
        assert await asyncio.gather(*burst) == [[1]] * 6
        await prefill.close()
    finally:
        for task in burst:
            task.cancel()
        for task in serving:
            task.cancel()
        for runtime in [caller, *workers]:
            await runtime.shutdown()
