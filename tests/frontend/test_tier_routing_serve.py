"""Tier-aware routing through `kvbaton serve --engine mocker --workers 2 --kv-offload-gib` (real
processes, the official `openai` client): a prompt evicted from one worker's pool into its host
memory goes back to that worker, which loads it, although the other worker's emptier pool wins
a tie on the pool alone."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvbaton.llm.hashing import reusable_blocks
from tests.frontend.conftest import Deployment, live_instances, load_of, start_serve, stop_serve
from tests.helpers import scraped, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK_SIZE = 16
PROMPT = [random.Random(0).randrange(10, 300) for _ in range(200)]
LOADED = reusable_blocks(len(PROMPT), BLOCK_SIZE)


@pytest.fixture(scope="module")
def deployment(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    served = start_serve(
        chat_model,
        tmp_path_factory.mktemp("discovery"),
        "--engine", "mocker",
        "--workers", "2",
        "--speedup-ratio", "10",
        "--block-size", str(BLOCK_SIZE),
        "--num-kv-blocks", "40",
        "--kv-offload-gib", "0.01",
    )  # fmt: skip
    yield served
    stop_serve(served.proc)


def complete(
    deployment: Deployment, prompt: list[int], worker: int | None = None
) -> tuple[int, int]:
    """The worker that served a 2-token completion of `prompt` (pinned to `worker` if given),
    and its cached prompt tokens."""
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="none")
    nvext = {"backend_instance_id": worker} if worker is not None else None
    response = client.completions.with_raw_response.create(
        model=deployment.model,
        prompt=prompt,
        max_tokens=2,
        extra_body={"nvext": nvext} if nvext else None,
    )
    out = response.parse()
    assert out.usage is not None
    details = out.usage.prompt_tokens_details
    return int(response.headers["x-kvbaton-worker"], 16), (
        details.cached_tokens or 0
    ) if details else 0


async def test_a_prompt_in_a_workers_host_memory_goes_back_to_it(deployment: Deployment) -> None:
    owner, cached = complete(deployment, PROMPT)
    assert cached == 0
    (other,) = set(live_instances(deployment.url, deployment.model)) - {owner}
    for seed in range(1, 5):  # unrelated prompts on the owner evict PROMPT from its pool
        rng = random.Random(seed)
        complete(deployment, [rng.randrange(10, 300) for _ in range(200)], owner)
    tiers = (await load_of(deployment.discovery, owner)).kv_tiers
    assert tiers is not None and tiers.host_blocks >= LOADED
    metrics = f"{deployment.url}/metrics"
    await wait_until(  # the router has every host-tier event the owner sent
        lambda: (
            scraped(metrics, "kvbaton_router_indexed_tier_blocks", worker=f"{owner:x}", tier="host")
            == tiers.host_blocks
        ),
        30,
        "the router's index of the owner's host tier",
    )
    own_pool = scraped(metrics, "kvbaton_router_indexed_blocks", worker=f"{owner:x}")
    assert scraped(metrics, "kvbaton_router_indexed_blocks", worker=f"{other:x}") < own_pool
    assert complete(deployment, PROMPT) == (owner, LOADED * BLOCK_SIZE)
    tiers = (await load_of(deployment.discovery, owner)).kv_tiers
    assert tiers is not None and tiers.hit_blocks_host == LOADED
