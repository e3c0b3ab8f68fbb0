"""The frontend's optional API key: asked of every route but the probes' and the cluster page's
files, in OpenAI's error shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvbaton.frontend.asgi import RequestIdAndLimits
from tests.frontend.conftest import start_frontend, stop_cleanly


async def ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def client(api_key: str | None) -> httpx.AsyncClient:
    app = RequestIdAndLimits(ok_app, 1 << 20, api_key)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


@pytest.mark.unit
async def test_routes_need_the_key_and_probes_do_not() -> None:
    async with client("s3cret") as http:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            r = await http.post("/v1/chat/completions", json={}, headers=headers)
            assert r.status_code == 401, headers
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert "x-request-id" in r.headers
        r = await http.get("/v1/models", headers={"authorization": "Bearer s3cret"})
        assert r.status_code == 200
        r = await http.post("/v1/messages", json={}, headers={"x-api-key": "s3cret"})
        assert r.status_code == 200  # Anthropic's clients send it so
        r = await http.post("/v1/messages", json={}, headers={"x-api-key": "wrong"})
        assert r.status_code == 401  # in Anthropic's shape, on its route
        assert r.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": r.json()["error"]["message"]},
        }
        assert (await http.post("/busy_threshold", json={})).status_code == 401
        for probe in ("/health", "/live", "/metrics"):
            assert (await http.get(probe)).status_code == 200
        # The cluster page's files are open (a navigation carries no header); its data is not.
        for page in ("/dashboard", "/dashboard/dashboard.js"):
            assert (await http.get(page)).status_code == 200
        for data in ("/v1/cluster", "/dashboards", "/dashboardx/y"):
            assert (await http.get(data)).status_code == 401, data
    async with client(None) as http:  # no key set: nothing is asked
        assert (await http.get("/v1/models")).status_code == 200
    async with client("") as http:
        assert (await http.get("/v1/models")).status_code == 200


@pytest.mark.integration
def test_the_official_client_with_and_without_the_key(tmp_path: Path) -> None:
    frontend = start_frontend(tmp_path / "discovery", "t", "--api-key", "s3cret")
    try:
        base = f"{frontend.url}/v1"
        bad = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
        with bad, pytest.raises(openai.AuthenticationError, match="API key"):
            bad.models.list()
        with openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0) as good:
            assert good.models.list().data == []
        assert httpx.get(f"{frontend.url}/live").status_code == 200
    finally:
        stop_cleanly(frontend)
