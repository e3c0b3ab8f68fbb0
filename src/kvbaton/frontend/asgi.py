"""Thin ASGI layers in front of the app.

- The request id (`x-request-id`) is echoed on every response.
- The API key: 401 unless `Authorization: Bearer <key>`, compared in constant time. Asked on
  every route but /health, /live and /metrics (open for probes and scrapers) and the cluster
  page's files, which a browser fetches without the header (the page asks for the key and
  sends it with its own calls, /v1/cluster among them).
- The body size limit: 413 before the app reads a byte too many.
- The requests that a stopping server cuts end in OpenAI's shape (`EndCutRequests`)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvbaton.frontend.errors import OpenAIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/live", "/metrics", "/dashboard"})  # no API key asked
OPEN_PREFIX = "/dashboard/"  # the cluster page's files (its data, /v1/cluster, needs the key)
_GOOD_ID = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII, no spaces


class RequestIdAndLimits:
    def __init__(self, app: ASGIApp, max_body_bytes: int, api_key: str | None = None) -> None:
        """`api_key` None or empty: no key is asked for."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._bearer = f"Bearer {api_key}".encode() if api_key else None
        self._key = api_key.encode() if api_key else b""  # as Anthropic's clients send it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = content_length = None
        authorization = x_api_key = b""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                given = value.decode("latin-1")
            elif name == b"content-length":
                content_length = value
            elif name == b"authorization":
                authorization = value
            elif name == b"x-api-key":
                x_api_key = value
        request_id = given if given and _GOOD_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        id_header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), id_header]
            await send(message)

        if (
            self._bearer is not None
            and scope["path"] not in OPEN_PATHS
            and not scope["path"].startswith(OPEN_PREFIX)
            and not hmac.compare_digest(authorization, self._bearer)
            and not hmac.compare_digest(x_api_key, self._key)
        ):
            error = OpenAIError(
                401,
                "a valid API key is needed: Authorization: Bearer KEY (or x-api-key: KEY)",
                code="invalid_api_key",
            )
            headers = [(b"www-authenticate", b"Bearer")]
            return await _reject(send_with_id, error, scope["path"], headers)
        if content_length is not None:
            if not content_length.isdigit() or int(content_length) > self.max_body_bytes:
                return await self._too_large(send_with_id, scope["path"])
        elif scope["method"] in ("POST", "PUT", "PATCH"):  # chunked: read it all, bounded
            body = bytearray()
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.max_body_bytes:
                    return await self._too_large(send_with_id, scope["path"])
            receive = replay(bytes(body), receive)
        return await self.app(scope, receive, send_with_id)

    async def _too_large(self, send: Send, path: str) -> None:
        error = OpenAIError(
            413,
            f"the request body is over the limit of {self.max_body_bytes} bytes",
            code="request_too_large",
        )
        await _reject(send, error, path)


async def _reject(
    send: Send, error: OpenAIError, path: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Answer with `error` (in the shape of `path`'s API) without reading the request's body
    (so the connection closes)."""
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"connection", b"close"),
                *(headers or ()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": error.json_for(path)})


class EndCutRequests:
    """The requests still running when the server's graceful shutdown is over are cancelled
    (uvicorn's way); each ends here in OpenAI's shape instead of a reset connection and a
    logged traceback.

    - Not answered yet: a 503 with code `shutting_down`.
    - Mid-stream (SSE): one error event with that code, then the stream ends.
    - A cancellation while the server is not stopping, or of a response that already ended or
      is not a stream, is passed on.
    """

    def __init__(self, app: ASGIApp, stopping: Callable[[], bool]) -> None:
        self.app = app
        self.stopping = stopping

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = ended = streaming = False

        async def tracked(message: Message) -> None:
            nonlocal started, ended, streaming
            if message["type"] == "http.response.start":
                started = True
                streaming = any(
                    name == b"content-type" and value.startswith(b"text/event-stream")
                    for name, value in message.get("headers", ())
                )
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if not self.stopping() or ended or (started and not streaming):
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # handled: the request ends here
            error = OpenAIError(
                503, "the server stopped before this request ended", code="shutting_down"
            )
            log.warning("request %s cut: the server stopped", scope["path"])
            if not started:
                await _reject(send, error, scope["path"])
            else:
                chunk = b"data: " + error.json() + b"\n\n"
                await send({"type": "http.response.body", "body": chunk, "more_body": False})


def replay(body: bytes, receive: Receive) -> Receive:
    """`receive` with the body, already read, given again first."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
