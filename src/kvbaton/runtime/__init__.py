"""The distributed runtime: discovery with leases, the request plane, clients. It knows nothing
of LLMs and can serve any async handler."""

from kvbaton.runtime.client import Client, ResponseStream
from kvbaton.runtime.context import Context
from kvbaton.runtime.distributed import Component, DistributedRuntime, Endpoint, Namespace
from kvbaton.runtime.errors import (
    BadRequestError,
    ConnectError,
    DeadlineExceededError,
    EndpointNotFoundError,
    FrameError,
    HandlerError,
    NoInstancesError,
    RuntimeServiceError,
    RuntimeShutDownError,
    ShuttingDownError,
    StreamBrokenError,
    StreamLimitError,
)
from kvbaton.runtime.settings import RuntimeSettings

__all__ = [
    "BadRequestError",
    "Client",
    "Component",
    "ConnectError",
    "Context",
    "DeadlineExceededError",
    "DistributedRuntime",
    "Endpoint",
    "EndpointNotFoundError",
    "FrameError",
    "HandlerError",
    "Namespace",
    "NoInstancesError",
    "ResponseStream",
    "RuntimeServiceError",
    "RuntimeSettings",
    "RuntimeShutDownError",
    "ShuttingDownError",
    "StreamBrokenError",
    "StreamLimitError",
]
