"""A frontend with no copy of the model's files gets the tokenizer from a worker over the
request plane (frontend and workers on different machines)."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import msgspec
import pytest

from kvbaton.frontend.models import ModelManager
from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.runtime import DistributedRuntime
from kvbaton.workers.fixed_engine import FixedTokensEngine
from kvbaton.workers.llm_worker import LLMWorker
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


async def test_tokenizer_files_come_from_the_worker(
    chat_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manager makes a directory only to fetch into (a frontend killed before its close
    leaves whatever it made), and removes it at close."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    async with (
        DistributedRuntime("mem://fetch") as worker_rt,
        DistributedRuntime("mem://fetch") as frontend_rt,
    ):
        worker = LLMWorker(
            worker_rt, FixedTokensEngine(str(chat_model), [5]), served_name="tiny", namespace="t"
        )
        serving = asyncio.create_task(worker.serve())
        manager = ModelManager(frontend_rt, "t")
        await manager.start()
        try:
            await wait_until(lambda: manager.get("tiny") is not None, 30.0, "model served")
            served = manager.get("tiny")
            assert served is not None
            assert not os.listdir(tmp_path), "a directory made with nothing to fetch"
            card = msgspec.structs.replace(served.card, model_path="/nonexistent/elsewhere")
            fetched_dir = await manager.fetch_tokenizer_files(card)
            assert fetched_dir != chat_model and fetched_dir.is_relative_to(tmp_path)
            fetched = Tokenizer(fetched_dir)
            local = Tokenizer(chat_model)
            text = "Grüße 🙂 The capital"
            assert fetched.encode(text) == local.encode(text)
            messages = [{"role": "user", "content": "hi"}]
            assert fetched.apply_chat_template(messages) == local.apply_chat_template(messages)
        finally:
            await manager.close()
            await worker_rt.shutdown()
            await serving
        assert not os.listdir(tmp_path)  # the manager cleans up what it fetched
