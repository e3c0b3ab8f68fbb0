"""The planner's local connector with a vLLM worker (issue 30): scaled 0 -> 1 -> 0, the worker
registers, computes on the core slot it was given, answers as vLLM's offline engine does, and on
scale-down ends with its vLLM processes.

Runs where vLLM is installed (the environment scripts/vllm_env.sh builds):
`.venv-vllm/bin/python -m pytest -m vllm tests/planner/test_vllm_local.py`; skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from tokenizers import Tokenizer

from kvbaton.engine.vllm_reaper import descendants, start_time
from kvbaton.llm.model_files import served_name
from kvbaton.planner.connectors.local import LocalConnector
from kvbaton.protocols.llm import EngineOutput, PreprocessedRequest, SamplingParams
from kvbaton.runtime import DistributedRuntime
from tests.frontend.vllm_helpers import (
    ENGINE_FLAGS,
    MAX_TOKENS,
    MODEL_DIR,
    READY_S,
    VLLM_MARKS,
    offline_texts,
    prompt_ids,
)
from tests.helpers import clean_env, wait_until

pytestmark = VLLM_MARKS


async def test_the_local_connector_scales_a_vllm_worker_up_and_down(
    tmp_path: Path, discovery_url: str
) -> None:
    expected = offline_texts()[0]  # before the worker starts: not sharing the cores
    args = [
        *("--role", "agg", "--engine", "vllm", "--model", str(MODEL_DIR), *ENGINE_FLAGS),
        *("--discovery", discovery_url, "--namespace", "t"),
    ]
    env = clean_env()
    slot = str(max(os.sched_getaffinity(0)))  # vLLM's own binding leaves the last core out
    connector = LocalConnector(
        {"decode": args}, env=env, log_dir=tmp_path / "logs", core_slots=[slot]
    )
    runtime = DistributedRuntime(discovery_url)
    try:
        generate = await runtime.endpoint("t.backend.generate").client(response_type=EngineOutput)
        await connector.scale("decode", 1)
        (pid,) = connector.pids("decode")
        await wait_until(lambda: len(generate.instance_ids()) == 1, READY_S, "the vLLM worker")
        processes = [pid, *descendants(pid)]
        assert slot in thread_cores(processes)
        request = PreprocessedRequest(
            model=served_name(str(MODEL_DIR)),
            token_ids=prompt_ids()[0],
            sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
        )
        outputs = [out async for out in generate.round_robin(request)]
        token_ids = [t for out in outputs for t in out.token_ids]
        assert outputs[-1].finish_reason == "length" and len(token_ids) == MAX_TOKENS
        tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
        assert tokenizer.decode(token_ids) == expected

        await connector.scale("decode", 0)
        assert await connector.current() == {"prefill": 0, "decode": 0}
        await wait_until(lambda: not generate.instance_ids(), 30, "the worker deregistered")
        await wait_until(
            lambda: all(start_time(p) is None for p in processes),
            60,
            "the worker and its vLLM processes ending",
        )
    finally:
        await connector.close()
        await runtime.shutdown()


def thread_cores(pids: list[int]) -> set[str]:
    """The CPU lists the threads of `pids` may run on (from /proc)."""
    cores = set()
    for pid in pids:
        for status in Path(f"/proc/{pid}/task").glob("*/status"):
            with contextlib.suppress(OSError):
                for line in status.read_text().splitlines():
                    if line.startswith("Cpus_allowed_list:"):
                        cores.add(line.split(":", 1)[1].strip())
    return cores
