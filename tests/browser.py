"""Headless Chromium for the tests of the cluster page: Debian's `chromium` package (`.ci/run`
installs it), driven by Playwright with the system browser's path (Playwright's own browser
downloads cannot be reached).

- Every request the page makes and every console error it logs are recorded.
- The browser starts with no network of its own (no background connections, no QUIC) and a
  new, empty profile; it is closed when the context manager exits.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from playwright.sync_api import Page, sync_playwright

CHROMIUM_ENV = "KVBATON_CHROMIUM"  # another browser binary than the distribution's
FLAGS = [
    "--no-sandbox",  # the tests run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str:
    path = os.environ.get(CHROMIUM_ENV) or shutil.which("chromium")
    if path is None:
        raise RuntimeError(
            "no chromium: install Debian's package (apt-get install chromium), as .ci/run does, "
            f"or name a Chromium binary in {CHROMIUM_ENV}"
        )
    return path


@dataclass
class BrowserPage:
    page: Page
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    errors: list[str] = field(default_factory=list)  # console errors and uncaught exceptions


@contextmanager
def browser_page(width: int = 1400, height: int = 1000) -> Iterator[BrowserPage]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            seen = BrowserPage(page)
            page.on("request", lambda request: seen.requests.append(request.url))
            page.on(
                "console",
                lambda message: (
                    seen.errors.append(message.text) if message.type == "error" else None
                ),
            )
            page.on("pageerror", lambda error: seen.errors.append(str(error)))
            yield seen
        finally:
            browser.close()
