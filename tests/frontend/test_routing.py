"""Routing through a real deployment: `kvbaton serve --engine mocker --workers 2`, and more
frontends on the same workers with other router modes. Responses name the worker that served
them (`x-kvbaton-worker`) and the prompt tokens served from its cache."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.frontend.conftest import (
    Deployment,
    start_frontend,
    start_serve,
    stop_serve,
    wait_for_health,
)
from tests.helpers import wait_until_sync

pytestmark = pytest.mark.integration

NAMESPACE = "kvbaton"  # serve's default


@pytest.fixture(scope="module")
def mockers(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    discovery = tmp_path_factory.mktemp("discovery")
    deployment = start_serve(
        chat_model,
        discovery,
        "--engine",
        "mocker",
        "--workers",
        "2",
        "--block-size",
        "4",
        "--num-kv-blocks",
        "1024",
        "--speedup-ratio",
        "100",
        "--log-level",
        "WARNING",  # serve still finds the frontend's address and says it is ready
    )
    wait_for_health(deployment.url, deployment.model, 2)
    yield deployment
    stop_serve(deployment.proc)


@pytest.fixture(scope="module")
def frontends(mockers: Deployment) -> Iterator[dict[str, Deployment]]:
    """One more frontend per router mode, on the same two workers."""
    discovery = Path(mockers.discovery.removeprefix("file://"))
    started: dict[str, Deployment] = {}
    try:
        for name, flags in {
            "round-robin": ["--router-mode", "round-robin"],
            "direct": ["--router-mode", "direct"],
            "kv-approx": ["--router-mode", "kv", "--no-kv-events"],
        }.items():
            started[name] = start_frontend(discovery, NAMESPACE, *flags)
            wait_for_health(started[name].url, mockers.model, 2)
        yield started
    finally:
        for deployment in started.values():
            stop_serve(deployment.proc)


def complete(url: str, model: str, prompt: str, **extra: object) -> tuple[str, int, int]:
    """(the worker that served it, its cached prompt tokens, its prompt tokens), through the
    official openai client."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    raw = client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=3, extra_body=extra or None
    )
    usage = raw.parse().usage
    assert usage is not None
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details else 0
    return raw.headers["x-kvbaton-worker"], cached, usage.prompt_tokens


def indexed_blocks(url: str, model: str, worker: str) -> int:
    """The blocks the frontend's KV router has indexed on `worker` (its metrics; 0: none)."""
    found = re.search(
        rf'kvbaton_router_indexed_blocks{{component="[^"]+",model="{model}",worker="{worker}"}}'
        r" (\d+)",
        httpx.get(f"{url}/metrics").text,
    )
    return int(found.group(1)) if found else 0


PROMPT = "Once upon a time a little fox walked into the forest to look for berries. " * 2


def test_kv_mode_sends_a_prompt_back_to_the_worker_that_cached_it(mockers: Deployment) -> None:
    url, model = mockers.url, mockers.model
    worker, cached, prompt_tokens = complete(url, model, PROMPT)
    assert cached == 0
    wait_until_sync(  # the worker's KV events reached the router
        lambda: indexed_blocks(url, model, worker) >= prompt_tokens // 4,
        30,
        "the router indexing the first prompt's blocks",
    )
    others = {
        complete(url, model, f"{i}: something else entirely, prompt {i}")[0] for i in range(6)
    }
    assert len(others) == 2  # on empty caches and equal load, the work spreads
    again, cached, prompt_tokens = complete(url, model, PROMPT)
    assert again == worker
    assert cached == (prompt_tokens - 1) // 4 * 4  # every full block but one token to compute
    longer, cached_longer, _ = complete(url, model, PROMPT + " And then it rained.")
    assert longer == worker and cached_longer >= cached
    assert re.search(  # labelled with its workers' component
        rf'kvbaton_router_requests_total{{component="[^".]+\.backend",mode="kv",model="{model}",'
        rf'worker="{worker}"}}',
        httpx.get(f"{url}/metrics").text,
    )
    assert indexed_blocks(url, model, worker) >= cached // 4  # the fox's blocks


def test_a_request_can_name_its_worker(mockers: Deployment) -> None:
    url, model = mockers.url, mockers.model
    workers = httpx.get(f"{url}/health").json()["models"][model]
    for worker in workers:
        served, _, _ = complete(url, model, PROMPT, nvext={"backend_instance_id": worker})
        assert served == worker
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    for bad in ("zz", "1234", 5):
        with pytest.raises(openai.BadRequestError, match="backend_instance_id"):
            client.completions.create(
                model=model, prompt="hi", extra_body={"nvext": {"backend_instance_id": bad}}
            )
    with pytest.raises(openai.BadRequestError, match="overlap_score_weight"):
        client.completions.create(
            model=model,
            prompt="hi",
            extra_body={"nvext": {"router_config_override": {"overlap_score_weight": -1}}},
        )


def test_other_router_modes(mockers: Deployment, frontends: dict[str, Deployment]) -> None:
    model = mockers.model
    rr = [complete(frontends["round-robin"].url, model, PROMPT)[0] for _ in range(4)]
    assert rr[0] != rr[1] and rr[0::2] == [rr[0]] * 2 and rr[1::2] == [rr[1]] * 2

    approx = frontends["kv-approx"].url
    first, _, _ = complete(approx, model, "The approximate router remembers what it sent. " * 2)
    again, _, _ = complete(approx, model, "The approximate router remembers what it sent. " * 2)
    assert again == first

    client = openai.OpenAI(base_url=f"{frontends['direct'].url}/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="backend_instance_id"):
        client.completions.create(model=model, prompt="hi")
    worker = rr[1]
    assert (
        complete(frontends["direct"].url, model, "hi", nvext={"backend_instance_id": worker})[0]
        == worker
    )
