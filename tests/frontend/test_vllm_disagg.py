"""`kvbaton serve --engine vllm --mode disagg` on SmolLM2 (issue 30): a prefill worker and a decode
worker, vLLM's NIXL connector moving the prompt's KV between their engines (on a CPU, from host
memory). Greedy answers equal vLLM's own offline ones, as the aggregated ones do
(`test_vllm_serve.py`), each one went through both workers, and serve stopped mid-stream drains
the stream, then ends every process, vLLM's included.

Runs where vLLM is installed (the environment scripts/vllm_env.sh builds):
`.venv-vllm/bin/python -m pytest -m vllm tests/frontend/test_vllm_disagg.py`; skipped elsewhere.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import openai
import pytest

from kvbaton.engine.vllm_reaper import descendants, start_time
from tests.frontend.conftest import Deployment, stop_serve
from tests.frontend.vllm_helpers import (
    MAX_TOKENS,
    VLLM_MARKS,
    offline_texts,
    prompt_ids,
    serve_vllm,
)
from tests.helpers import wait_until_sync

pytestmark = VLLM_MARKS
DISAGG = ["--mode", "disagg", "--prefill-workers", "1", "--decode-workers", "1"]


@pytest.fixture(scope="module")
def offline() -> list[str]:
    return offline_texts()


@pytest.fixture(scope="module")
def disagg(offline: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = serve_vllm(tmp_path_factory.mktemp("discovery"), *DISAGG)
    yield deployment
    stop_serve(deployment.proc)


def test_disaggregated_greedy_answers_equal_vllm_offline(
    disagg: Deployment, offline: list[str]
) -> None:
    served, workers = [], []
    with openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="none", max_retries=0) as client:
        for ids in prompt_ids():
            raw = client.completions.with_raw_response.create(
                model=disagg.model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0
            )
            served.append(raw.parse().choices[0].text)
            workers.append(raw.headers["x-kvbaton-worker"].split(","))
    assert served == offline
    assert all(len(set(pair)) == 2 for pair in workers), workers  # prefilled, then decoded


def test_a_disaggregated_stream_counts_every_token(disagg: Deployment, offline: list[str]) -> None:
    """Streamed: the prefill worker's first token, then the decode worker's, once each."""
    ids = prompt_ids()[-1]
    with openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="none", max_retries=0) as client:
        stream = client.completions.create(
            model=disagg.model,
            prompt=ids,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text == offline[-1]
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), MAX_TOKENS)


def test_serve_stopped_mid_stream_drains_it_then_ends_every_process(
    disagg: Deployment, offline: list[str]
) -> None:
    """SIGINT to serve after the stream's first tokens: the stream still runs to its end (the
    workers drain), serve exits 0, and no process of the deployment outlives it. Last here."""
    pids = [disagg.proc.pid, *descendants(disagg.proc.pid)]
    texts: list[str] = []
    with openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="none", max_retries=0) as client:
        stream = client.completions.create(
            model=disagg.model,
            prompt=prompt_ids()[-1],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        for chunk in stream:
            texts += [choice.text for choice in chunk.choices]
            if len(texts) == 2:
                disagg.proc.send_signal(signal.SIGINT)
    assert "".join(texts) == offline[-1]
    assert disagg.proc.wait(60) == 0
    wait_until_sync(
        lambda: all(start_time(pid) is None for pid in pids), 30, "processes outliving serve"
    )
