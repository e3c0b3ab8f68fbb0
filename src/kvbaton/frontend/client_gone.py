"""Work done for an HTTP client, stopped as soon as the client disconnects.

Starlette's StreamingResponse does this with an anyio task group (a task for the body, one for
the disconnect, and their cancel scopes) on every streamed request; here the work runs in the
request's own task and one watcher task cancels it where it waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Coroutine
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientLeftError(Exception):
    """The client disconnected before the work was done."""


async def while_connected(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result; ClientLeftError if the client left first.

    - `work` runs in the calling task; a disconnect cancels it where it waits.
    - A cancellation from elsewhere passes through as CancelledError.
    - `receive` is read only for the disconnect: call it once the request's body was read.
    """
    task = asyncio.current_task()
    assert task is not None
    working = True
    left = False

    def client_left(watcher: asyncio.Future[None]) -> None:
        nonlocal left
        if working and not watcher.cancelled():
            watcher.exception()  # retrieved: a receive that failed leaves no client either
            left = True
            task.cancel()

    watcher = asyncio.ensure_future(_disconnect(receive))
    watcher.add_done_callback(client_left)
    try:
        result = await work
    except asyncio.CancelledError:
        if left and task.uncancel() == 0:
            raise ClientLeftError from None
        raise
    finally:
        working = False
        watcher.cancel()
    if left:  # the work swallowed the cancellation
        task.uncancel()
        raise ClientLeftError
    return result


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """A streamed response (server-sent events) that stops, and closes its body, once the
    client leaves; its body is closed whatever ends it."""

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str]) -> None:
        super().__init__(events, headers=headers, media_type="text/event-stream")
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await while_connected(receive, self.stream_response(send))
        except ClientLeftError:
            pass
        finally:
            await self._events.aclose()
