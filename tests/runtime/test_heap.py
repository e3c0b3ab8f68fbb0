"""The heap trimmer: glibc's free pages go back to the kernel, on a timer, off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from kvbaton.runtime import heap
from tests.helpers import wait_until


def test_trim_returns_freed_pages_on_glibc() -> None:
    if heap.glibc() is None:
        pytest.skip("not glibc")
    blocks = [bytearray(4096) for _ in range(20_000)]
    del blocks[::2]
    assert heap.trim_heap()


async def test_trims_on_a_timer_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    if heap.glibc() is None:
        pytest.skip("not glibc")
    loop_thread = threading.get_ident()
    threads: list[int] = []

    def trim() -> bool:
        threads.append(threading.get_ident())
        return True

    monkeypatch.setattr(heap, "trim_heap", trim)
    task = asyncio.create_task(heap.trim_heap_every(0.01))
    await wait_until(lambda: len(threads) >= 3, timeout=10)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert loop_thread not in threads
