"""A zero-cost stand-in for the engine: every request gets the same fixed tokens at once.

It measures what surrounds the engine (frontend, request plane, worker) with the engine's cost
taken out. It needs a model directory only for the tokenizer files that frontends fetch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path

from kvbaton.engine.connector import EngineRequest
from kvbaton.engine.engine import EngineStats
from kvbaton.llm.model_files import resolve_model
from kvbaton.protocols.kv import KvDump
from kvbaton.protocols.llm import EngineOutput, Usage


class FixedTokensEngine:
    def __init__(self, model: str, token_ids: list[int], *, max_model_len: int = 4096) -> None:
        if not token_ids:
            raise ValueError("the fixed engine needs at least one token id")
        self.model_dir: Path = resolve_model(model)
        self.token_ids = token_ids
        self.max_model_len = max_model_len
        self.block_size = 16

    async def add_request(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Runs whole requests only (an "agg" worker): the KV connector's fields are ignored."""
        request.params.validate()
        return self._outputs(request)

    async def _outputs(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        max_tokens = request.params.max_tokens
        tokens = (self.token_ids * (max_tokens // len(self.token_ids) + 1))[:max_tokens]
        yield EngineOutput(
            request_id=request.request_id,
            token_ids=tokens,
            finish_reason="length",
            usage=Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(tokens)),
        )

    def release_kv(self, request_id: str) -> None:
        return None

    def reclaim_kv_blocks(self) -> None:
        return None

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 0, 0, 0.0)

    async def clear_kv_blocks(self) -> int:
        return 0

    async def kv_dump(self) -> KvDump:
        return KvDump(last_event_id=-1, block_hashes=[])

    async def wait_failed(self) -> str:
        """Never returns: nothing here can break."""
        never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        return await never

    async def shutdown(self) -> None:
        return None
