"""The context a handler receives beside its request."""

from __future__ import annotations

import asyncio


class Context:
    """Per-request state on the serving side.

    Invariant: once `is_stopped()` is true it stays true. It turns true when the caller cancels,
    when the caller's connection goes, when the deadline passes or when the handler calls
    `stop_generating()`. A handler that does not look is cancelled after a short grace period.
    """

    __slots__ = ("_event", "_stopped", "deadline", "id")

    def __init__(self, request_id: str, deadline: float | None = None) -> None:
        self.id = request_id
        self.deadline = deadline  # seconds since the epoch, or None
        self._stopped = False
        self._event: asyncio.Event | None = None  # made only for a handler that waits on it

    def is_stopped(self) -> bool:
        return self._stopped

    def stop_generating(self) -> None:
        self._stopped = True
        if self._event is not None:
            self._event.set()

    async def stopped(self) -> None:
        """Wait until the request is stopped."""
        if not self._stopped:
            if self._event is None:
                self._event = asyncio.Event()
            await self._event.wait()

    def __repr__(self) -> str:
        return f"Context(id={self.id!r}, stopped={self.is_stopped()})"
