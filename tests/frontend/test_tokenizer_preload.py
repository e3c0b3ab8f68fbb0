"""A frontend imports transformers' tokenizer classes (seconds: torch comes with them) as it
starts, before any worker registers, so that its first model's tokenizer only reads files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbaton.llm.tokenizer import Tokenizer

pytestmark = pytest.mark.integration

STARTED_FRONTEND = """
import asyncio, json, sys, time
from kvbaton.frontend.models import ModelManager
from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.runtime import DistributedRuntime

AUTO = "transformers.models.auto.tokenization_auto"

async def main(model):
    async with DistributedRuntime("mem://preload") as runtime:
        manager = ModelManager(runtime, "t")
        before = AUTO in sys.modules
        await manager.start()
        deadline = time.monotonic() + 120
        while AUTO not in sys.modules and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        after = AUTO in sys.modules
        tokenizer = await asyncio.to_thread(Tokenizer, model)
        await manager.close()
    print(json.dumps([before, after, tokenizer.encode("hello world")]))

asyncio.run(main(sys.argv[1]))
"""


def test_a_started_frontend_imports_the_tokenizer_classes_with_no_worker(
    chat_model: Path,
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", STARTED_FRONTEND, str(chat_model)],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    ).stdout
    before, after, tokens = json.loads(out.splitlines()[-1])
    assert not before, "the frontend's modules import transformers' tokenizers themselves"
    assert after, "no tokenizer preload once the frontend started"
    assert tokens == Tokenizer(chat_model).encode("hello world")
