"""Work for a client stopped when it disconnects, with a scripted ASGI `receive` in place of a
server: the work's result, its cancellation where it waits, and the streamed body's close."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from kvbaton.frontend.client_gone import ClientLeftError, EventStream, while_connected

pytestmark = pytest.mark.unit


class Client:
    """ASGI `receive` that answers `http.disconnect` once `leave()` was called."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    def leave(self) -> None:
        self.gone.set()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def test_work_done_while_connected_gives_its_result_and_leaves_no_watcher() -> None:
    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    before = asyncio.all_tasks()
    assert await while_connected(Client().receive, work()) == 7
    await asyncio.sleep(0)  # the watcher's cancellation lands
    assert asyncio.all_tasks() == before


async def test_a_client_leaving_cancels_the_work_where_it_waits() -> None:
    client = Client()
    stopped = asyncio.Event()

    async def work() -> None:
        try:
            client.leave()
            await asyncio.sleep(3600)
        finally:
            stopped.set()

    with pytest.raises(ClientLeftError):
        await while_connected(client.receive, work())
    assert stopped.is_set()
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # none left counted on this task
    await asyncio.sleep(0)


async def test_work_that_swallows_the_cancellation_still_reports_the_client_gone() -> None:
    client = Client()

    async def work() -> int:
        client.leave()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)
        return 1

    with pytest.raises(ClientLeftError):
        await while_connected(client.receive, work())
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_cancellation_from_elsewhere_passes_through() -> None:
    task = asyncio.ensure_future(while_connected(Client().receive, asyncio.sleep(3600)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_event_stream_sends_its_events_and_stops_when_the_client_leaves() -> None:
    sent: list[dict[str, Any]] = []
    closed: list[str] = []

    async def events(client: Client | None) -> AsyncGenerator[bytes, None]:
        try:
            yield b"data: 1\n\n"
            if client is not None:
                client.leave()
                await asyncio.sleep(3600)
            yield b"data: 2\n\n"
        finally:
            closed.append("closed")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    await EventStream(events(None), {})(scope, Client().receive, send)
    assert [m.get("body") for m in sent] == [None, b"data: 1\n\n", b"data: 2\n\n", b""]
    assert sent[-1]["more_body"] is False and closed == ["closed"]
    sent.clear()
    client = Client()
    await EventStream(events(client), {})(scope, client.receive, send)
    assert [m.get("body") for m in sent] == [None, b"data: 1\n\n"]  # no end: the client left
    assert closed == ["closed", "closed"]


async def test_a_receive_that_fails_counts_as_the_client_gone() -> None:
    async def broken() -> dict[str, Any]:
        raise OSError("connection reset")

    with pytest.raises(ClientLeftError):
        await while_connected(broken, asyncio.sleep(3600))
