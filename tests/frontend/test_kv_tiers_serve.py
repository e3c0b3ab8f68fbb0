"""`kvbaton serve --kv-disk-dir` with two workers on one host (real processes, the official
`openai` client): a prompt evicted from one worker's pool is served by the other worker from
the shared disk tier, and by the first worker's restarted process after a SIGKILL, with the
greedy answer of its first computation, its blocks counted as cached tokens and as disk hits
in the worker's load report."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.frontend.conftest import (
    Deployment,
    live_instances,
    load_of,
    serve_slot,
    start_serve,
    stop_serve,
)
from tests.frontend.kv_tiers_helpers import (
    BLOCK_SIZE,
    CACHED,
    PROMPT,
    offloaded,
    other_prompts,
)
from tests.helpers import wait_until, wait_until_sync

pytestmark = [pytest.mark.integration, pytest.mark.slow]

POOL_BLOCKS = 32
RESTART_S = 60.0


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def deployment(
    chat_model: Path, disk: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    served = start_serve(
        chat_model,
        tmp_path_factory.mktemp("discovery"),
        "--workers", "2",
        "--router-mode", "direct",
        "--block-size", str(BLOCK_SIZE),
        "--num-kv-blocks", str(POOL_BLOCKS),
        "--kv-disk-dir", str(disk),
        "--kv-disk-gib", "1",
    )  # fmt: skip
    yield served
    stop_serve(served.proc)


def complete(deployment: Deployment, prompt: list[int], worker: int) -> tuple[str, int]:
    """The greedy completion of `prompt` on `worker`, and its cached prompt tokens."""
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="none")
    out = client.completions.create(
        model=deployment.model,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"nvext": {"backend_instance_id": worker}},
    )
    assert out.usage is not None
    details = out.usage.prompt_tokens_details
    return out.choices[0].text, (details.cached_tokens or 0) if details else 0


def evict(deployment: Deployment, worker: int) -> None:
    """Prompts unrelated to PROMPT until the worker's pool reused all its blocks."""
    for prompt in other_prompts():
        complete(deployment, prompt, worker)


async def disk_hits(deployment: Deployment, worker: int) -> int:
    tiers = (await load_of(deployment.discovery, worker)).kv_tiers
    assert tiers is not None
    return tiers.hit_blocks_disk


async def test_a_worker_serves_a_prefix_another_offloaded(
    deployment: Deployment, disk: Path
) -> None:
    first, second = live_instances(deployment.url, deployment.model)
    answer, cached = complete(deployment, PROMPT, first)
    assert cached == 0
    evict(deployment, first)
    wait_until_sync(lambda: offloaded(disk), 30, "the prompt offloaded")
    assert complete(deployment, PROMPT, second) == (answer, CACHED)
    assert await disk_hits(deployment, second) == CACHED // BLOCK_SIZE


async def test_a_restarted_worker_serves_a_known_prefix_from_disk(
    deployment: Deployment,
) -> None:
    slot = serve_slot(deployment, "worker-0")
    old = set(live_instances(deployment.url, deployment.model))
    answer, _ = complete(deployment, PROMPT, min(old))
    evict(deployment, min(old))
    evict(deployment, max(old))  # neither pool keeps it
    os.kill(int(slot["pid"]), signal.SIGKILL)
    await wait_until(
        lambda: len(set(live_instances(deployment.url, deployment.model)) - old) == 1,
        RESTART_S,
        "the worker back",
    )
    (restarted,) = set(live_instances(deployment.url, deployment.model)) - old
    assert complete(deployment, PROMPT, restarted) == (answer, CACHED)
    assert await disk_hits(deployment, restarted) == CACHED // BLOCK_SIZE
