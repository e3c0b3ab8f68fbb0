"""A process's system server (`--system-port`): `/live`, `/health` and `/metrics` over HTTP, for
Kubernetes probes and Prometheus.

- `/live` answers 200 while the process's event loop runs (a model may still be loading).
- `/health` answers 200 while the runtime serves at least one endpoint and is not shutting
  down, else 503; the body names the endpoints. It says what this process knows of itself,
  never what discovery shows (readers hide the keys of pods that are not ready: a health that
  waited for discovery would never turn ready).
- `/metrics`: prometheus_client's default registry (the process's metrics).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn
from prometheus_client import make_asgi_app

from kvbaton.runtime.http_embed import EmbeddedUvicorn, listen

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Health = Callable[[], tuple[bool, dict[str, Any]]]


def system_app(health: Health) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    metrics = make_asgi_app()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/metrics":
            await metrics(scope, receive, send)
            return
        if path == "/live":
            status, body = 200, {"status": "live"}
        elif path == "/health":
            ready, body = health()
            status = 200 if ready else 503
        else:
            status, body = 404, {"error": f"no {path} here: /live, /health, /metrics"}
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    return app


class SystemServer:
    def __init__(self, host: str, port: int, health: Health) -> None:
        self.sock = listen(host, port)
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        config = uvicorn.Config(
            system_app(health), lifespan="off", log_level="warning", access_log=False
        )
        self.server = EmbeddedUvicorn(config)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.sock]))

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            await self._task
        self.sock.close()
