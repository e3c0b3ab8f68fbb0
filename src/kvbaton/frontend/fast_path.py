"""The generation routes served without FastAPI's per-request machinery (routing by regex,
dependency solving, its middleware stack), which took about a third of the frontend's CPU per
request (py-spy, at concurrency 64).

Invariant: a request takes the fast path only where FastAPI would hand the route's handler the same
validated body: a JSON content type (FastAPI's strict rule: none is not JSON), a body that msgspec
decodes (strict JSON, for which `json.loads`, FastAPI's parser, gives equal objects) and that the
body model validates in Python mode, as FastAPI does. Every other request, and every other route,
goes to the FastAPI app with the body replayed, so that its errors keep FastAPI's shapes and
/openapi.json still lists every route."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pydantic
from fastapi import Request
from fastapi.responses import Response

from kvbaton.frontend.asgi import ASGIApp, Receive, Scope, Send, replay

Handler = Callable[[Request, Any], Awaitable[Response]]  # (request, its validated body)


class FastPath:
    def __init__(
        self, app: ASGIApp, routes: dict[str, tuple[type[pydantic.BaseModel], Handler]]
    ) -> None:
        """`routes`: POST path -> (body model, handler of the validated body)."""
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST" or not _json_content(scope["headers"]):
            return await self.app(scope, receive, send)
        request = Request(scope, receive)
        raw = await request.body()
        model, handler = route
        try:
            body = model.model_validate(msgspec.json.decode(raw), from_attributes=True)
        except (msgspec.DecodeError, pydantic.ValidationError):
            return await self.app(scope, replay(raw, receive), send)  # FastAPI's error for it
        response = await handler(request, body)
        await response(scope, receive, send)


def _json_content(headers: list[tuple[bytes, bytes]]) -> bool:
    """FastAPI's rule for parsing a body as JSON (strict content type): application/json or
    application/*+json, parameters such as charset aside."""
    for name, value in headers:
        if name == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            main, _, sub = kind.partition(b"/")
            return (
                main == b"application"
                and b"/" not in sub
                and (sub == b"json" or sub.endswith(b"+json"))
            )
    return False
