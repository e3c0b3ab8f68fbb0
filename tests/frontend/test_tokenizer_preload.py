"""A frontend imports transformers' tokenizer classes (seconds: torch comes with them) as it
starts, before any worker registers, so that its first model's tokenizer only reads files."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbaton.llm.tokenizer import Tokenizer
from tests.helpers import fresh_interpreter

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
    before, after, tokens = fresh_interpreter(STARTED_FRONTEND, str(chat_model))
    assert not before, "the frontend's modules import transformers' tokenizers themselves"
    assert after, "no tokenizer preload once the frontend started"
    assert tokens == Tokenizer(chat_model).encode("hello world")
