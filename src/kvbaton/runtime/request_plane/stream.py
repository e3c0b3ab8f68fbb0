"""The calling side of the request plane, whatever carries its frames: a `ClientConnection` over
an asyncio transport carries any number of concurrent `Stream`s, multiplexed by stream id. Each
transport's client (tcp, nats, http) makes the connections and keeps them in its pool."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from kvbaton.protocols.frames import Cancel, Credit, Data, End, Error, ErrorKind, Frame, Request
from kvbaton.runtime.errors import (
    BadRequestError,
    DeadlineExceededError,
    EndpointNotFoundError,
    FrameError,
    HandlerError,
    RuntimeServiceError,
    ShuttingDownError,
    StreamBrokenError,
    StreamLimitError,
)
from kvbaton.runtime.request_plane.connection import FrameConnection
from kvbaton.runtime.settings import RuntimeSettings

DEADLINE_SLACK_S = 0.5  # past the deadline, wait this long for the server's own error frame

_ERRORS: dict[str, type[RuntimeServiceError]] = {
    ErrorKind.NOT_FOUND: EndpointNotFoundError,
    ErrorKind.SHUTTING_DOWN: ShuttingDownError,
    ErrorKind.DEADLINE: DeadlineExceededError,
    ErrorKind.BAD_REQUEST: BadRequestError,
    ErrorKind.STREAM_LIMIT: StreamLimitError,
}


def error_from_frame(frame: Error) -> RuntimeServiceError:
    cls = _ERRORS.get(frame.kind)
    return cls(frame.message) if cls is not None else HandlerError(frame.message, frame.error_type)


class Stream:
    """The responses of one request, as an async iterator of decoded items.

    Ends with StopAsyncIteration after the `End` frame; raises the error an `Error` frame carries,
    or StreamBrokenError when the connection goes first. `cancel()`, or cancellation of the task
    that reads it, sends `Cancel` to the handler. The connection holds every open stream, so an
    abandoned one is cancelled by its owner (`ResponseStream`), never by garbage collection.
    """

    def __init__(
        self,
        conn: ClientConnection,
        stream_id: int,
        decoder: msgspec.msgpack.Decoder[Any],
        deadline: float | None = None,
        window: int = 0,
    ) -> None:
        self._conn = conn
        self._deadline = deadline
        self._grant_every = max(1, window // 2) if window else 0
        self._read = 0  # responses read since the last Credit
        self.stream_id = stream_id
        self._decoder = decoder
        # Responses not yet read, then possibly the end: End, Error or a StreamBrokenError.
        self._items: deque[msgspec.Raw | End | Error | BaseException] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.done = False

    def _push(self, payloads: list[msgspec.Raw]) -> None:
        self._items.extend(payloads)
        self._wake()

    def _end(self, end: End | Error | BaseException) -> None:
        self._items.append(end)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        while not self._items:
            if self.done:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                if self._deadline is None:
                    await self._waiter
                else:  # the server enforces it too; this side holds even if the server hangs
                    remaining = self._deadline - time.time() + DEADLINE_SLACK_S
                    await asyncio.wait_for(self._waiter, max(0.0, remaining))
            except TimeoutError:
                self.cancel()
                raise DeadlineExceededError("deadline exceeded (no answer)") from None
            except asyncio.CancelledError:
                self.cancel()
                raise
            finally:
                self._waiter = None
        item = self._items.popleft()
        if type(item) is msgspec.Raw:
            return self._decode(item)
        self.done = True
        if type(item) is End:
            raise StopAsyncIteration
        if isinstance(item, Error):
            raise error_from_frame(item)
        assert isinstance(item, BaseException)
        raise item

    def ready(self) -> bool:
        """A response has arrived and not been read: `take` returns it."""
        return bool(self._items) and type(self._items[0]) is msgspec.Raw

    def take(self) -> Any:
        """The response that `ready` says has arrived, without waiting."""
        item = self._items.popleft()
        assert type(item) is msgspec.Raw
        return self._decode(item)

    def _decode(self, item: msgspec.Raw) -> Any:
        if self._grant_every:
            self._read += 1
            if self._read >= self._grant_every:
                self._conn.send(Credit(self.stream_id, self._read))
                self._read = 0
        return self._decoder.decode(item)

    def cancel_threadsafe(self) -> None:
        """`cancel` from any thread (a finalizer may run on one that is not the loop's)."""
        if not self.done:
            self._conn.loop.call_soon_threadsafe(self.cancel)

    def cancel(self) -> None:
        """Stop the remote handler (idempotent; a no-op after the stream ended)."""
        if self.done:
            return
        self.done = True
        self._items.clear()
        if self._conn.streams.pop(self.stream_id, None) is not None:
            self._conn.send(Cancel(self.stream_id))

    async def aclose(self) -> None:
        self.cancel()


class ConnectionPool(Protocol):
    settings: RuntimeSettings

    def discard(self, conn: ClientConnection) -> None:
        """Forget a connection that closed."""


class ConnectionsByAddress:
    """A client's connections, one per peer address (tcp, nats); a `ConnectionPool`."""

    def __init__(self, settings: RuntimeSettings) -> None:
        self.settings = settings
        self._conns: dict[str, ClientConnection] = {}

    def connections(self) -> list[str]:
        """Addresses with an open connection."""
        return [a for a, c in self._conns.items() if not c.closed]

    def open_streams(self) -> int:
        return sum(len(c.streams) for c in self._conns.values())

    def discard(self, conn: ClientConnection) -> None:
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]


class ClientConnection(FrameConnection):
    def __init__(self, pool: ConnectionPool, address: str) -> None:
        super().__init__(pool.settings.max_frame_bytes)
        self.pool = pool
        self.address = address
        self.streams: dict[int, Stream] = {}
        self._ids = itertools.count(1)

    def open(
        self,
        endpoint: str,
        payload: msgspec.Raw,
        request_id: str,
        deadline: float | None,
        decoder: msgspec.msgpack.Decoder[Any],
    ) -> Stream:
        if self.closed:
            raise StreamBrokenError(f"connection to {self.address} lost")
        window = self.pool.settings.stream_window
        stream = Stream(self, next(self._ids), decoder, deadline, window)
        self.send(Request(stream.stream_id, endpoint, request_id, payload, deadline, window))
        self.streams[stream.stream_id] = stream
        return stream

    def frame_received(self, frame: Frame) -> None:
        # Frames are msgspec Structs that nothing subclasses: `type(...) is` is exact, and a
        # tenth of isinstance's cost on them. A stream not here was cancelled by us: its late
        # frames are dropped.
        if type(frame) is Data:
            stream = self.streams.get(frame.stream_id)
            if stream is not None:
                stream._push(frame.payloads)
        elif type(frame) is End or type(frame) is Error:
            stream = self.streams.pop(frame.stream_id, None)
            if stream is not None:
                stream._end(frame)
        else:
            raise FrameError(f"unexpected {type(frame).__name__} frame from a server")

    def connection_closed(self, exc: BaseException | None) -> None:
        self.pool.discard(self)
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream._end(
                StreamBrokenError(
                    f"stream {stream.stream_id} to {self.address} broke before its end: "
                    f"{exc or 'connection closed'}"
                )
            )


T = TypeVar("T")


class Dials(Generic[T]):
    """One dial per address at a time: concurrent callers share it, and a caller that is
    cancelled leaves it running for the others."""

    def __init__(self, dial: Callable[[str], Awaitable[T]]) -> None:
        self._dial = dial
        self._running: dict[str, asyncio.Task[T]] = {}

    async def __call__(self, address: str) -> T:
        task = self._running.get(address)
        if task is None:
            task = asyncio.ensure_future(self._dial(address))
            self._running[address] = task
            task.add_done_callback(functools.partial(self._done, address))
        return await asyncio.shield(task)

    def _done(self, address: str, task: asyncio.Task[T]) -> None:
        del self._running[address]
        if not task.cancelled():
            task.exception()  # retrieved here: every caller may have been cancelled meanwhile

    def cancel(self) -> None:
        for task in list(self._running.values()):
            task.cancel()
