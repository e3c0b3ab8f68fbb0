"""Client of one endpoint: tracks its live instances from discovery and routes requests.

Instances come and go with their discovery keys. An instance that cannot be connected to is
quarantined at once (left out of routing) until its key goes, its key is written again, or the
quarantine (one lease TTL) runs out. `round_robin`, `random` and `ordered` try the next instance
when a connection fails or an instance refuses the request unrun (it is draining, or no longer
serves the endpoint), since nothing ran; `direct` does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Generator
from typing import TYPE_CHECKING, Any

from kvbaton.protocols.discovery import Instance
from kvbaton.runtime.discovery import PrefixWatch
from kvbaton.runtime.errors import (
    ConnectError,
    EndpointNotFoundError,
    NoInstancesError,
    ShuttingDownError,
    StreamLimitError,
)
from kvbaton.runtime.names import EndpointPath
from kvbaton.runtime.request_plane.framing import encode_payload
from kvbaton.runtime.request_plane.stream import Stream

if TYPE_CHECKING:
    from kvbaton.runtime.distributed import DistributedRuntime

log = logging.getLogger(__name__)

RETRY_REFUSALS = 3  # instances a request may be refused by before the refusal is raised


_ID_PREFIX = uuid.uuid4().hex[:12]
_ID_COUNTER = itertools.count()


def _new_request_id() -> str:
    """Unique across processes (random per-process prefix) and cheap (a counter)."""
    return f"{_ID_PREFIX}-{next(_ID_COUNTER):x}"


class ResponseStream:
    """The responses to one call. Iterate it directly, or `await` it first to send the request
    (and learn `instance_id`) before reading. Leaving it early cancels the remote handler."""

    def __init__(
        self,
        client: Client,
        request: Any,
        targets: list[int] | None,
        mode: str,
        request_id: str | None,
        timeout: float | None,
    ) -> None:
        self._client = client
        self._request = request
        self._targets = targets
        self._mode = mode
        self.request_id = request_id or _new_request_id()
        self._deadline = None if timeout is None else time.time() + timeout
        self._stream: Stream | None = None
        self._closed = False
        self._started = False  # the first response (or end) was read
        self._refused: set[int] = set()  # instances that refused this request unrun
        self.instance_id: int | None = None

    async def open(self) -> ResponseStream:
        if self._stream is None and not self._closed:
            self.instance_id, self._stream = await self._client._send(
                self._request,
                self._mode,
                self._targets,
                self.request_id,
                self._deadline,
                self._refused,
            )
        return self

    def __await__(self) -> Generator[Any, None, ResponseStream]:
        return self.open().__await__()

    def __aiter__(self) -> ResponseStream:
        return self

    def __anext__(self) -> Awaitable[Any]:
        if self._started:  # the common case: no extra coroutine per response
            assert self._stream is not None
            return self._stream.__anext__()
        return self._first()

    def ready(self) -> bool:
        """A response after the first has arrived and not been read: `take` returns it."""
        return self._started and self._stream is not None and self._stream.ready()

    def take(self) -> Any:
        """The response that `ready` says has arrived, without waiting."""
        assert self._stream is not None
        return self._stream.take()

    async def _first(self) -> Any:
        """The first response. An instance that refuses a request it never ran (draining, or
        no longer serving the endpoint) is skipped for the next one, except with `direct`."""
        refusal: Exception | None = None
        while True:
            if self._closed:
                raise StopAsyncIteration
            try:
                await self.open()
            except NoInstancesError:
                if refusal is not None:
                    raise refusal from None
                raise
            assert self._stream is not None and self.instance_id is not None
            try:
                item = await self._stream.__anext__()
            except (ShuttingDownError, EndpointNotFoundError, StreamLimitError) as exc:
                if self._mode == "direct" or len(self._refused) >= RETRY_REFUSALS:
                    raise
                log.info(
                    "instance %x refused %s (%s); trying another",
                    self.instance_id,
                    self.request_id,
                    exc,
                )
                refusal = exc
                self._refused.add(self.instance_id)
                self._stream = None
                continue
            self._started = True
            return item

    async def aclose(self) -> None:
        self._closed = True
        if self._stream is not None:
            self._stream.cancel()

    def __del__(self) -> None:
        # `break` out of `async for` drops the stream: stop the remote handler at once.
        if self._stream is not None and not self._stream.done:
            with contextlib.suppress(RuntimeError):  # the loop may be closed at exit
                self._stream.cancel_threadsafe()

    async def __aenter__(self) -> ResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Client:
    def __init__(
        self, runtime: DistributedRuntime, path: EndpointPath, response_type: Any = Any
    ) -> None:
        self._runtime = runtime
        self.path = path
        self.response_type = response_type
        self._instances: dict[int, Instance] = {}
        self._quarantine: dict[int, float] = {}  # instance id -> monotonic time it ends
        self._changed = asyncio.Event()
        self._available_ids: list[int] | None = None  # cache of _available(); None: stale
        self._rr = 0
        self._watch_task: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        watch = await self._runtime.discovery.watch_prefix(self.path.key_prefix())
        for key, value in watch.snapshot.items():
            self._apply("put", key, value)
        self._watch_task = asyncio.create_task(self._follow(watch), name=f"watch {self.path}")

    async def _follow(self, watch: PrefixWatch) -> None:
        try:
            async for event in watch:
                self._apply(event.kind, event.key, event.value)
        finally:
            await watch.aclose()

    def _apply(self, kind: str, key: str, value: bytes | None) -> None:
        instance_id = self.path.instance_id_from_key(key)
        if instance_id is None:
            return
        if kind == "delete" or value is None:
            if self._instances.pop(instance_id, None) is not None:
                log.info("instance %x of %s left", instance_id, self.path)
        else:
            try:
                self._instances[instance_id] = Instance.from_json(value)
            except Exception as exc:
                log.warning("ignoring unreadable discovery record %s: %s", key, exc)
                return
        self._quarantine.pop(instance_id, None)
        self._mark_changed()

    def _mark_changed(self) -> None:
        self._available_ids = None
        self._changed.set()
        self._changed = asyncio.Event()

    # -- instances ---------------------------------------------------------------------------
    def _available(self) -> list[int]:
        if self._quarantine:
            now = time.monotonic()
            for iid, until in list(self._quarantine.items()):
                if until <= now:
                    del self._quarantine[iid]
                    self._available_ids = None
        if self._available_ids is None:
            self._available_ids = sorted(i for i in self._instances if i not in self._quarantine)
        return self._available_ids

    def instance_ids(self) -> list[int]:
        """Live instances that are not quarantined, in ascending order."""
        return list(self._available())

    def instances(self) -> list[Instance]:
        return [self._instances[i] for i in self._available()]

    def quarantine(self, instance_id: int) -> None:
        if instance_id in self._instances:
            self._quarantine[instance_id] = time.monotonic() + self._runtime.settings.lease_ttl
            self._mark_changed()

    async def wait_for_change(self) -> None:
        """Return once an instance comes, goes, or is quarantined or let out."""
        await self._changed.wait()

    async def wait_for_instances(self, timeout: float | None = None) -> list[int]:
        """Wait until at least one instance is available; NoInstancesError after `timeout`
        (default: the runtime's wait_for_instances_timeout)."""
        limit = self._runtime.settings.wait_for_instances_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not (ids := self._available()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoInstancesError(f"no instance of {self.path} appeared within {limit:g}s")
            changed = self._changed
            with contextlib.suppress(TimeoutError):  # (not wait_for: see router/kv_events.py)
                async with asyncio.timeout(min(remaining, 1.0)):
                    await changed.wait()
        return list(ids)

    # -- calls -------------------------------------------------------------------------------
    def round_robin(
        self, request: Any, *, request_id: str | None = None, timeout: float | None = None
    ) -> ResponseStream:
        return ResponseStream(self, request, None, "round_robin", request_id, timeout)

    def random(
        self, request: Any, *, request_id: str | None = None, timeout: float | None = None
    ) -> ResponseStream:
        return ResponseStream(self, request, None, "random", request_id, timeout)

    def direct(
        self,
        request: Any,
        instance_id: int,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> ResponseStream:
        return ResponseStream(self, request, [instance_id], "direct", request_id, timeout)

    def ordered(
        self,
        request: Any,
        instance_ids: list[int],
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> ResponseStream:
        """The first of `instance_ids` (the caller's choice, best first) that takes the request;
        live ones only. Like `round_robin`, a failed connection or a refusal passes it on."""
        return ResponseStream(self, request, list(instance_ids), "ordered", request_id, timeout)

    generate = round_robin

    def _order(self, mode: str, targets: list[int] | None) -> list[int]:
        if mode == "direct":
            assert targets is not None
            (target,) = targets
            if target not in self._instances:
                raise NoInstancesError(f"instance {target:x} of {self.path} is not known")
            return targets
        ids = self._available()
        if mode == "ordered":
            assert targets is not None
            live = set(ids)
            ids = [i for i in targets if i in live]
        if not ids:
            raise NoInstancesError(f"no live instance of {self.path}")
        if mode == "random":
            return random.sample(ids, len(ids))
        if mode == "round_robin":
            start = self._rr % len(ids)
            self._rr += 1
            return ids[start:] + ids[:start]
        return ids

    async def _send(
        self,
        request: Any,
        mode: str,
        targets: list[int] | None,
        request_id: str,
        deadline: float | None,
        exclude: set[int],
    ) -> tuple[int, Stream]:
        payload = encode_payload(request)
        last_error: ConnectError | None = None
        order = [i for i in self._order(mode, targets) if i not in exclude]
        if not order:
            raise NoInstancesError(f"every live instance of {self.path} refused the request")
        for instance_id in order:
            instance = self._instances.get(instance_id)
            if instance is None:
                continue
            try:
                stream = await self._runtime.request_client.open_stream(
                    instance.address,
                    str(self.path),
                    payload,
                    request_id=request_id,
                    deadline=deadline,
                    response_type=self.response_type,
                )
            except ConnectError as exc:
                log.warning("quarantining instance %x of %s: %s", instance_id, self.path, exc)
                self.quarantine(instance_id)
                last_error = ConnectError(str(exc), instance_id)
                continue
            return instance_id, stream
        if last_error is not None:
            raise last_error
        raise NoInstancesError(f"no live instance of {self.path}")

    async def close(self) -> None:
        """Stop watching discovery. Streams already open go on."""
        if self in self._runtime._clients:
            self._runtime._clients.remove(self)
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
            self._watch_task = None
