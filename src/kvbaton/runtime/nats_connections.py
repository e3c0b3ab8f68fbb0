"""The NATS connections of one process: one per server URL, shared by the request plane (both
sides) and the event plane.

Invariants: the first connection to a server fails with ConnectError within `connect_timeout`
when the server cannot be reached; once connected, a connection reconnects forever (nats-py
re-subscribes every subscription and keeps what is published meanwhile in its pending buffer),
so a server restart costs its users a pause, not a rebuild."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvbaton.runtime.errors import ConnectError
from kvbaton.runtime.settings import RuntimeSettings

if TYPE_CHECKING:  # nats-py (with aiohttp) costs ~0.3 s to import: only processes using NATS pay
    from nats.aio.client import Client as NatsClient

log = logging.getLogger(__name__)

RECONNECT_WAIT_S = 0.25
PING_INTERVAL_S = 2  # the client notices a dead server after 2 missed pings


class NatsConnections:
    def __init__(self, settings: RuntimeSettings) -> None:
        self.settings = settings
        self._conns: dict[str, asyncio.Task[NatsClient]] = {}
        self._listeners: list[Callable[[str, bool], None]] = []
        self._closed = False

    def add_listener(self, listener: Callable[[str, bool], None]) -> Callable[[], None]:
        """Call `listener(url, connected)` when a connection is lost (False) and when it is
        back (True): what was in flight meanwhile may be lost, in either direction. Returns
        the function that removes the listener."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _tell(self, url: str, connected: bool) -> None:
        for listener in list(self._listeners):
            try:
                listener(url, connected)
            except Exception:
                log.exception("NATS connection listener failed")

    async def get(self, url: str) -> NatsClient:
        """The connection to `url`, made on first use; ConnectError if it cannot be made (or
        the connections were closed)."""
        if self._closed:
            raise ConnectError(f"the NATS connections of this process are closed ({url})")
        task = self._conns.get(url)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.create_task(self._connect(url), name=f"nats-connect {url}")
            self._conns[url] = task
        return await asyncio.shield(task)

    async def _connect(self, url: str) -> NatsClient:
        from nats.aio.client import Client as NatsClient

        conn = NatsClient()

        async def disconnected() -> None:
            if not conn.is_closed and not conn.is_draining:
                log.warning("NATS %s: disconnected; reconnecting", url)
            self._tell(url, False)

        async def reconnected() -> None:
            log.info("NATS %s: reconnected", url)
            self._tell(url, True)

        async def error(exc: Exception) -> None:
            # Refused reconnection attempts are expected while the server is down (the
            # disconnect was logged); what else goes wrong (a slow consumer dropping messages,
            # a protocol error) is worth a warning.
            expected = isinstance(exc, OSError)  # (nats-py's TimeoutError is one)
            level = logging.DEBUG if expected else logging.WARNING
            log.log(level, "NATS %s: %r", url, exc)

        options: dict[str, Any] = {  # (nats-py annotates its seconds as int; floats work)
            "connect_timeout": self.settings.connect_timeout,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": RECONNECT_WAIT_S,
            "ping_interval": PING_INTERVAL_S,
            "max_outstanding_pings": 2,
            "disconnected_cb": disconnected,
            "reconnected_cb": reconnected,
            "error_cb": error,
            # A publish that finds the pending buffer full waits for the flusher: at most this
            # long (it raises then), not until the server is back.
            "flush_timeout": self.settings.connect_timeout,
        }
        # nats-py, told to reconnect forever, retries a first connection forever as well:
        # the first one is bounded here.
        try:
            async with asyncio.timeout(self.settings.connect_timeout):
                await conn.connect(url, **options)
        except BaseException as exc:  # NoServersError, TimeoutError, OSError; or cancelled
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await conn.close()
            if not isinstance(exc, Exception):
                raise
            reason = str(exc) or type(exc).__name__
            raise ConnectError(
                f"cannot connect to NATS at {url} within {self.settings.connect_timeout:g}s: "
                f"{reason}"
            ) from exc
        return conn

    async def close(self) -> None:
        """Flush what is pending and close every connection (bounded). Later `get`s fail."""
        self._closed = True
        tasks, self._conns = list(self._conns.values()), {}
        for task in tasks:
            if not task.done():
                task.cancel()  # `_connect` closes what it had made
                await asyncio.gather(task, return_exceptions=True)
                continue
            if task.cancelled() or task.exception() is not None:
                continue
            conn = task.result()
            try:
                async with asyncio.timeout(2.0):
                    await conn.drain()
            except Exception as exc:  # a server that is down: close without waiting
                log.debug("NATS drain failed (%s); closing", exc)
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await conn.close()
