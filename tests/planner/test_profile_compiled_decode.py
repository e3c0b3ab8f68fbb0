"""`kvbaton profile` measures a worker's decode curve only once its compiled single decode has
settled (`settle_compiled_decode`): never partly eager and partly compiled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import pytest

from kvbaton.cli.profile import settle_compiled_decode
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import RuntimeServiceError
from tests.helpers import idle_load

pytestmark = pytest.mark.unit


def loads(*states: str) -> tuple[list[str], Callable[[], Awaitable[WorkerLoad]]]:
    """The worker's loads, one per state in turn (the last one for good); the states asked."""
    asked: list[str] = []
    given: Iterator[str] = iter(states)
    last = states[-1]

    async def load() -> WorkerLoad:
        nonlocal last
        last = next(given, last)
        asked.append(last)
        return idle_load(compiled_decode=last)

    return asked, load


@pytest.mark.parametrize("settled", ["on", "failed", "off"])
def test_it_waits_while_the_package_loads(settled: str) -> None:
    asked, load = loads("loading", "loading", settled)
    said: list[str] = []
    settle = settle_compiled_decode(load, lambda: None, said.append, poll_s=0)
    assert asyncio.run(settle) == settled
    assert asked == ["loading", "loading", settled]


def test_a_worker_that_exits_meanwhile_ends_the_wait() -> None:
    _, load = loads("loading")

    def alive() -> None:
        raise RuntimeServiceError("the worker exited (code 1)")

    with pytest.raises(RuntimeServiceError, match="exited"):
        asyncio.run(settle_compiled_decode(load, alive, print, poll_s=0))
