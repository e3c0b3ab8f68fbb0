"""Errors a caller of the runtime can see.

`StreamBrokenError` is kept apart from everything else: it means the responding process went
away (or the connection did) before the stream's end frame, so the request may be migrated.
`ConnectError`, `ShuttingDownError` and `StreamLimitError` mean the request was never started
and can be sent to another instance as it is.
"""

from __future__ import annotations


class RuntimeServiceError(Exception):
    """Base of every error the runtime raises to a caller."""


class HandlerError(RuntimeServiceError):
    """The remote handler raised; `error_type` names the remote exception's class."""

    def __init__(self, message: str, error_type: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.error_type = error_type


class EndpointNotFoundError(RuntimeServiceError):
    """The instance serves no such endpoint (it may have just stopped serving it)."""


class ShuttingDownError(RuntimeServiceError):
    """The instance is draining and refused a new request; the request never ran."""


class StreamLimitError(RuntimeServiceError):
    """The connection already had its most concurrent streams open; the request never ran."""


class RuntimeShutDownError(RuntimeServiceError, RuntimeError):
    """The runtime was shut down (a stop signal, say) before the call: nothing more can be
    served on it."""


class DeadlineExceededError(RuntimeServiceError, TimeoutError):
    """The request's deadline passed."""


class BadRequestError(RuntimeServiceError):
    """The handler's side could not decode the request as the type it expects."""


class StreamBrokenError(RuntimeServiceError, ConnectionError):
    """The stream ended without an end frame: the peer died or the connection was lost."""


class ConnectError(RuntimeServiceError, ConnectionError):
    """Could not connect to an instance; the request was not sent."""

    def __init__(self, message: str, instance_id: int | None = None) -> None:
        super().__init__(message)
        self.instance_id = instance_id


class NoInstancesError(RuntimeServiceError, TimeoutError):
    """No live instance serves the endpoint (within the wait allowed)."""


class FrameError(RuntimeServiceError):
    """A frame on the wire was malformed, truncated or over the size limit."""
