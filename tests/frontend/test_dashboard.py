"""The cluster page (`/dashboard`) in a real browser, headless Chromium, against `kvbaton serve
--engine mocker --workers 2`: it lists both workers, its request count and charts change after
requests, a killed worker shows as restarting and then up again, nothing is fetched from
outside the server and the console has no errors. Behind `--api-key` it asks for the key once
and then shows the data; a frontend that stops is shown as not live.

`KVBATON_DASHBOARD_SCREENSHOT=docs/dashboard.png` saves the README's screenshot of the page."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.browser import BrowserPage, browser_page
from tests.frontend.conftest import (
    Deployment,
    serve_slot,
    start_frontend,
    start_serve,
    stop_serve,
    wait_for_health,
)
from tests.helpers import wait_until_sync

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MOCKER = ("--engine", "mocker", "--block-size", "16", "--speedup-ratio", "1")
SCREENSHOT_ENV = "KVBATON_DASHBOARD_SCREENSHOT"
SHOWN_S = 30.0  # from a change in the cluster to the page showing it, at most
RESTARTED_S = 60.0  # from a kill to the worker's slot serving again, at most


@pytest.fixture(scope="module")
def cluster(chat_model: Path) -> Iterator[Deployment]:
    deployment = start_serve(chat_model, None, *MOCKER, "--workers", "2")
    wait_for_health(deployment.url, deployment.model, 2)
    yield deployment
    stop_serve(deployment.proc)


def _text(page: BrowserPage, selector: str) -> str:
    return page.page.locator(selector).inner_text()


def _worker_state(page: BrowserPage, name: str) -> str | None:
    row = page.page.locator(f'#workers tr[data-worker="{name}"]')
    return row.get_attribute("data-state") if row.count() else None


def _charted(page: BrowserPage) -> float:
    """The requests the page's rate chart shows."""
    return float(
        page.page.evaluate(
            "() => { const d = window.kvbatonDashboard;"
            " return d.charts.rate.data[1].reduce((a, b) => a + b, 0)"
            " * d.last.requests.step_s; }"
        )
    )


def _send(deployment: Deployment, requests: int) -> None:
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="none")
    for i in range(requests):
        answer = client.completions.create(
            model=deployment.model, prompt=f"tell me about item {i}", max_tokens=8
        )
        assert answer.choices[0].text is not None


def test_the_page_shows_the_cluster_live(cluster: Deployment) -> None:
    with browser_page() as page:
        page.page.goto(f"{cluster.url}/dashboard")
        page.page.wait_for_selector('#status[data-live="true"]')

        rows = page.page.locator("#workers tr[data-worker]")
        assert sorted(rows.evaluate_all("rs => rs.map(r => r.dataset.worker)")) == [
            "worker-0",
            "worker-1",
        ]
        assert {_worker_state(page, "worker-0"), _worker_state(page, "worker-1")} == {"up"}

        ended = int(_text(page, "#requests-ended"))
        _send(cluster, 6)
        wait_until_sync(
            lambda: int(_text(page, "#requests-ended")) >= ended + 6,
            SHOWN_S,
            "the page counting the requests sent",
        )
        wait_until_sync(lambda: _charted(page) >= 6, SHOWN_S, "the rate chart showing them")
        assert page.page.evaluate(
            "() => window.kvbatonDashboard.charts.ttft.data[1].some(v => v > 0)"
        )
        assert page.page.locator("#routes tbody tr").count() >= 6  # one decision per request

        victim = serve_slot(cluster, "worker-0")
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until_sync(
            lambda: _worker_state(page, "worker-0") == "restarting",
            SHOWN_S,
            "the killed worker shown as restarting",
        )
        wait_until_sync(
            lambda: _worker_state(page, "worker-0") == "up",
            RESTARTED_S,
            "the killed worker shown as up again",
        )
        restarts = page.page.locator('#workers tr[data-worker="worker-0"] td').nth(3)
        assert restarts.inner_text() == "1"
        assert _worker_state(page, "worker-1") == "up"

        if screenshot := os.environ.get(SCREENSHOT_ENV):
            wait_for_health(cluster.url, cluster.model, 2)  # the killed process's lease ended
            _send(cluster, 6)
            wait_until_sync(lambda: _charted(page) >= 12, SHOWN_S, "the page charting them")
            page.page.screenshot(path=screenshot, full_page=True)

        outside = [url for url in page.requests if not url.startswith(f"{cluster.url}/")]
        assert outside == []
        assert page.errors == []


def test_the_page_asks_for_the_key_and_says_when_it_is_not_live(cluster: Deployment) -> None:
    """A second frontend, with an API key, on the same cluster."""
    frontend = start_frontend(cluster.discovery, "kvbaton", "--api-key", "sesame")
    try:
        with browser_page() as page:
            page.page.goto(f"{frontend.url}/dashboard")  # the page itself needs no key
            page.page.wait_for_selector("#key-form:not([hidden])")
            assert page.page.get_attribute("#status", "data-live") == "false"

            page.page.fill("#key", "sesame")
            page.page.click("#key-form button")
            page.page.wait_for_selector('#status[data-live="true"]')
            assert page.page.locator("#key-form").is_hidden()
            assert page.page.locator("#workers tr[data-worker]").count() == 2

            stop_serve(frontend.proc)
            page.page.wait_for_selector('#status[data-live="false"]')
            assert "not live" in _text(page, "#status")
            assert "stale" in (page.page.get_attribute("#content", "class") or "")
    finally:
        stop_serve(frontend.proc)
