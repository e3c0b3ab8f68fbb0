"""`kvbaton serve --mode disagg` with the real SmolLM2 as the README shows it (slow: the model is
pulled and loaded twice): chat answers are token-identical to aggregated serving's, which the
same decode worker gives when a request names it, in both transfer orders; constrained ones
too (a JSON schema, a forced tool call)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvbaton.llm.model_files import pull
from tests.frontend.conftest import start_serve, stop_cleanly, wait_for_health

# A real model in both orders, on a machine whose other test process may be busy.
pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(300)]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
}
CONSTRAINED: list[dict[str, Any]] = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}},
    {
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": CITY}}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    },
]


@pytest.mark.parametrize("order", ["prefill-first", "decode-first"])
def test_smollm2_disaggregated_answers_equal_aggregated(tmp_path: Path, order: str) -> None:
    model = pull("smollm2", progress=lambda line: None)
    deployment = start_serve(
        model,
        tmp_path / "discovery",
        "--mode",
        "disagg",
        "--transfer-order",
        order,
    )
    try:
        wait_for_health(deployment.url, deployment.model, 1)
        health = httpx.get(f"{deployment.url}/health").json()
        (decode,) = health["models"][deployment.model]
        client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="none", max_retries=0)
        asked = [({}, q, 24) for q in QUESTIONS] + [(c, QUESTIONS[0], 60) for c in CONSTRAINED]
        for extra, question, tokens in asked:
            answers = []
            for nvext in (None, {"backend_instance_id": decode}):
                raw = client.chat.completions.with_raw_response.create(
                    model=deployment.model,
                    messages=[{"role": "user", "content": question}],
                    max_tokens=tokens,
                    temperature=0,
                    extra_body={**extra, "nvext": nvext} if nvext else extra or None,
                )
                served = raw.headers["x-kvbaton-worker"].split(",")
                assert len(served) == (2 if nvext is None else 1)
                message = raw.parse().choices[0].message
                calls = [c.function.arguments for c in message.tool_calls or []]  # type: ignore[union-attr]
                answers.append((message.content, calls))
            assert answers[0] == answers[1], (extra, question)
            assert answers[0][0] or answers[0][1]
    finally:
        stop_cleanly(deployment)
