"""The cluster page's files (`GET /dashboard`, `GET /dashboard/{name}`), served from the package:
no build step, nothing fetched from elsewhere (docs/cluster.md).

- Only the files named in `ASSETS` are served; any other name is a 404.
- Every answer carries a Content-Security-Policy that lets the page load and fetch from its
  own origin only.
- uPlot (the charts) is vendored unchanged from the npm package `uplot` 1.6.32 (MIT,
  `dashboard/uPlot.LICENSE`).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}
HEADERS = {
    "content-security-policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
        "connect-src 'self'; frame-ancestors 'none'"
    ),
    "cache-control": "no-cache",
    "x-content-type-options": "nosniff",
}


@cache
def asset(name: str) -> bytes | None:
    """The file's bytes (None: not one of the page's files)."""
    if name not in ASSETS:
        return None
    return resources.files("kvbaton.frontend").joinpath("dashboard", name).read_bytes()
