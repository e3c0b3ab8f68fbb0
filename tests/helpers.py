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


async def collect(stream: AsyncIterable[T], limit: int | None = None) -> list[T]:
    """The stream's items; with `limit`, only the first `limit` (the rest are not read)."""
    items: list[T] = []
    async for item in stream:
        items.append(item)
        if limit is not None and len(items) >= limit:
            break
    return items
