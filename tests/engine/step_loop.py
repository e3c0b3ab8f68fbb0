"""What every AsyncEngine (the step thread's, the mocker's loop task) must do when its step loop
breaks outside a step: fail every waiting caller, then refuse new ones with the reason."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import pytest

from kvbaton.engine import AsyncEngine
from kvbaton.engine.connector import EngineRequest
from kvbaton.protocols.llm import EngineOutput, SamplingParams


def _broken(request_id: str) -> None:
    raise KeyError(f"a bug, releasing {request_id}")


def break_the_step_loop(engine: AsyncEngine) -> None:
    """Make the engine's step loop raise KeyError (outside a step: in a message's handling)."""
    engine.engine.release_kv = _broken  # type: ignore[method-assign]
    engine.release_kv("any")


async def assert_a_broken_step_loop_fails_every_caller(
    engine: AsyncEngine, running: AsyncGenerator[EngineOutput, None], prompt: list[int]
) -> None:
    """`running`: a stream with outputs to come."""
    break_the_step_loop(engine)
    with pytest.raises(RuntimeError, match="step loop failed: KeyError"):
        async for _ in running:
            pass
    with pytest.raises(RuntimeError, match="step loop failed: KeyError"):
        await engine.add_request(EngineRequest("later", prompt, SamplingParams(max_tokens=1)))
    with pytest.raises(RuntimeError, match="step loop failed: KeyError"):
        await engine.kv_dump()
