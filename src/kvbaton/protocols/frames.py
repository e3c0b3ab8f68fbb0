"""Frames of the request plane.

A stream is opened by the client with `Request`, answered by zero or more `Data` frames and
closed by exactly one `End` or `Error`; the client may send `Cancel` at any time. Flow control
is per stream: a `Request` with a `window` of N lets the server send N responses, and each
`Credit` from the client lets it send that many more (a window of 0: no limit). Stream ids are
chosen by the client and are unique per connection. A `Data` frame carries one or more responses
of its stream, in order (a sender may coalesce responses produced together). Payloads are msgpack
documents carried as `msgspec.Raw`, so a frame is decoded without decoding what it carries.
"""

from __future__ import annotations

import enum

import msgspec

PROTOCOL_VERSION = 1


class ErrorKind(enum.StrEnum):
    """Why a stream ended in `Error`."""

    HANDLER = "handler"  # the handler raised; message carries its text
    NOT_FOUND = "not_found"  # no such endpoint on this instance; the request never ran
    SHUTTING_DOWN = "shutting_down"  # the instance is draining; the request never ran
    DEADLINE = "deadline"  # the request's deadline passed while it ran
    BAD_REQUEST = "bad_request"  # the payload could not be decoded as the handler's type
    STREAM_LIMIT = "stream_limit"  # the connection has its most open streams; never ran


class Request(msgspec.Struct, tag=0, array_like=True):
    stream_id: int
    endpoint: str
    request_id: str
    payload: msgspec.Raw
    deadline: float | None = None  # seconds since the epoch
    window: int = 0  # responses the server may send before it waits for Credit; 0: no limit


class Data(msgspec.Struct, tag=1, array_like=True):
    stream_id: int
    payloads: list[msgspec.Raw]


class End(msgspec.Struct, tag=2, array_like=True):
    stream_id: int


class Error(msgspec.Struct, tag=3, array_like=True):
    stream_id: int
    kind: str  # an ErrorKind value; an unknown kind is read as HANDLER
    message: str
    error_type: str = ""  # class name of the handler's exception, for HANDLER


class Cancel(msgspec.Struct, tag=4, array_like=True):
    stream_id: int


class Credit(msgspec.Struct, tag=5, array_like=True):
    stream_id: int
    responses: int  # the caller read this many more: the server may send as many more


Frame = Request | Data | End | Error | Cancel | Credit
