"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis: bodies, parameters and headers
that fit the schema, and ones that do not) against a real `kvbaton serve`: no request gets a
5xx, and the deployment serves as before afterwards."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.frontend.conftest import Deployment, start_serve, stop_cleanly

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fuzzed(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    # The fixed engine answers at no cost: the examples test the frontend, not a model's speed.
    deployment = start_serve(chat_model, tmp_path_factory.mktemp("discovery"), "--engine", "fixed")
    yield deployment
    alive = deployment.proc.poll() is None
    stop_cleanly(deployment)
    assert alive, deployment.log_text()[-3000:]


@pytest.fixture(scope="module")
def api_schema(fuzzed: Deployment) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error(case: schemathesis.Case, fuzzed: Deployment) -> None:
    body = case.body
    if (
        isinstance(body, dict)
        and isinstance(body.get("model"), str)
        and zlib.crc32(repr(body).encode()) % 4
    ):
        body["model"] = fuzzed.model  # mostly the served model: past the 404, into serving
    response = case.call(timeout=30)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])


def test_the_fuzzed_deployment_still_serves(fuzzed: Deployment) -> None:
    body = {"model": fuzzed.model, "prompt": "hello", "max_tokens": 3}
    r = httpx.post(f"{fuzzed.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
