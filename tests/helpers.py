"""Small helpers for tests: bounded waits and stream collection."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_until(
    predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition"
) -> float:
    """Poll `predicate` until it is true; returns the seconds waited, fails after `timeout`."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what} not met within {timeout}s")
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


async def collect(stream: AsyncIterable[T]) -> list[T]:
    return [item async for item in stream]
