"""KV tiers on a disaggregated deployment (`kvbaton serve --mode disagg --kv-disk-dir`, real
processes, the official `openai` client): a prompt evicted from the prefill worker's pool is
loaded from the disk tier by its next prefill, not computed again, and the greedy answer is the
one of its first computation, in both transfer orders."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import DistributedRuntime
from tests.frontend.conftest import (
    Deployment,
    start_serve,
    stop_serve,
    wait_for_health,
    worker_load,
)
from tests.frontend.kv_tiers_helpers import (
    BLOCK_SIZE,
    CACHED,
    PROMPT,
    offloaded,
    other_prompts,
)
from tests.helpers import wait_until_sync

pytestmark = [pytest.mark.integration, pytest.mark.slow]

POOL_BLOCKS = 32


@pytest.fixture(scope="module", params=["prefill-first", "decode-first"])
def disagg(
    request: pytest.FixtureRequest, chat_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Deployment, Path]]:
    disk = tmp_path_factory.mktemp("kv-disk")
    served = start_serve(
        chat_model,
        tmp_path_factory.mktemp("discovery"),
        "--mode", "disagg",
        "--transfer-order", request.param,
        "--block-size", str(BLOCK_SIZE),
        "--num-kv-blocks", str(POOL_BLOCKS),
        "--kv-disk-dir", str(disk),
        "--kv-disk-gib", "1",
    )  # fmt: skip
    wait_for_health(served.url, served.model, 1)
    yield served, disk
    stop_serve(served.proc)


def complete(deployment: Deployment, prompt: list[int]) -> str:
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="none")
    out = client.completions.create(
        model=deployment.model, prompt=prompt, max_tokens=8, temperature=0
    )
    return out.choices[0].text


async def prefill_load(discovery: str) -> WorkerLoad:
    async with DistributedRuntime(discovery) as runtime:
        return await worker_load(runtime, "kvbaton.prefill.load_metrics")


def test_a_prefill_worker_loads_an_evicted_prompt_from_disk(
    disagg: tuple[Deployment, Path],
) -> None:
    deployment, disk = disagg
    answer = complete(deployment, PROMPT)
    for prompt in other_prompts():  # until both pools reused all their blocks
        complete(deployment, prompt)
    wait_until_sync(lambda: offloaded(disk), 30, "the prompt offloaded")
    before = asyncio.run(prefill_load(deployment.discovery)).kv_tiers
    assert before is not None

    assert complete(deployment, PROMPT) == answer
    after = asyncio.run(prefill_load(deployment.discovery)).kv_tiers
    assert after is not None
    assert after.hit_blocks_disk - before.hit_blocks_disk == CACHED // BLOCK_SIZE
