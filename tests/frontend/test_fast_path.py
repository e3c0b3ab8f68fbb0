"""The generation routes' fast path: it serves exactly the requests that FastAPI would hand the
same handler with the same body, and every answer equals FastAPI's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import Request
from fastapi.responses import Response

from kvbaton.frontend.app import Frontend
from kvbaton.frontend.asgi import Message, Receive, RequestIdAndLimits, Scope, Send
from kvbaton.frontend.fast_path import FastPath
from kvbaton.frontend.openai_types import ChatCompletionRequest
from kvbaton.frontend.settings import BusyThresholds

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'

# (content type or None, body): every one of these leaves the fast path for FastAPI
FALLBACKS = [
    (None, CHAT),  # FastAPI's strict content type: no type, no JSON
    ("text/plain", CHAT),
    ("application/x/y+json", CHAT),
    ("application/json", b"{not json"),
    ("application/json", b""),
    ("application/json", b'{"model": "m", "messages": [], "temperature": NaN}'),
    ("application/json", b'{"model": "m", "messages": "\\ud800"}'),
    ("application/json", b'{"model": "m", "messages": []}'),  # fails validation
    ("application/json", b'{"model": 1, "messages": [{"role": "user", "content": "hi"}]}'),
    ("application/json", b'{"model": "m", "messages": [{"role": "user"}], "n": 17}'),
    ("application/json", b"[1, 2]"),
]
FAST = [
    ("application/json", CHAT),
    ("Application/JSON; charset=utf-8", CHAT),
    ("application/vnd.openai+json", CHAT),
]


class Recorder:
    """The app behind the fast path: records what reaches it, answers 299."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, more = b"", True
        while more:
            message: Message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.bodies.append(body)
        await Response(status_code=299)(scope, receive, send)


async def _post(app: Any, content_type: str | None, body: bytes, path: str) -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        request = http.build_request("POST", path, content=body, headers=headers)
        request.headers.pop("content-type", None)  # none, or as given below
        if content_type is not None:
            request.headers["content-type"] = content_type
        return await http.send(request)


@pytest.mark.parametrize(("content_type", "body"), FAST + FALLBACKS)
async def test_only_well_formed_json_bodies_take_the_fast_path(
    content_type: str | None, body: bytes
) -> None:
    handled: list[ChatCompletionRequest] = []

    async def handler(request: Request, parsed: ChatCompletionRequest) -> Response:
        handled.append(parsed)
        return Response(status_code=201)

    behind = Recorder()
    app = FastPath(behind, {"/v1/chat/completions": (ChatCompletionRequest, handler)})
    r = await _post(app, content_type, body, "/v1/chat/completions")
    if (content_type, body) in FAST:
        assert r.status_code == 201 and behind.bodies == []
        assert handled[0].messages[0].content == "hi"
    else:
        assert r.status_code == 299 and handled == []
        assert behind.bodies == [body]  # the body, already read, replayed whole


async def test_other_routes_and_methods_pass_by() -> None:
    async def handler(request: Request, parsed: Any) -> Response:
        raise AssertionError("not this route")

    behind = Recorder()
    app = FastPath(behind, {"/v1/chat/completions": (ChatCompletionRequest, handler)})
    assert (await _post(app, "application/json", CHAT, "/v1/completions")).status_code == 299
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.get("/v1/chat/completions")).status_code == 299


@pytest.mark.parametrize(("content_type", "body"), FAST + FALLBACKS)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_every_answer_equals_fastapis(
    content_type: str | None, body: bytes, path: str
) -> None:
    """No model is served: the well-formed requests get the 404 of an unknown model, the others
    FastAPI's 400s; through the fast path and through FastAPI alone alike."""
    models = SimpleNamespace(thresholds=BusyThresholds(), models={}, get=lambda name: None)
    frontend = Frontend(models)  # type: ignore[arg-type]
    fast = await _post(RequestIdAndLimits(frontend.app, 1 << 20), content_type, body, path)
    plain = await _post(RequestIdAndLimits(frontend.api, 1 << 20), content_type, body, path)
    assert (fast.status_code, fast.json()) == (plain.status_code, plain.json())
    assert fast.status_code in (400, 404)
