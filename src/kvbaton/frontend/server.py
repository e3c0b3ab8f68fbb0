"""The frontend process: the runtime (to find workers and call them), the model manager and an
HTTP server (uvicorn with httptools) on one event loop.

Every accepted connection has TCP_NODELAY set (the asyncio and uvloop transports set it), so
each SSE event leaves as soon as it is written. The heap is trimmed every minute while it serves
(`runtime/heap.py`): its resident memory follows what it holds, not its busiest minute's.

- The port is bound at construction (a busy port fails at once) and listened on once the models
  that discovery already lists are loaded (at most `MODELS_LOAD_S`): a replica that shares the
  port (`reuse_port`) gets no connection before it can serve them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable

import uvicorn

from kvbaton.frontend.app import Frontend
from kvbaton.frontend.asgi import EndCutRequests, RequestIdAndLimits
from kvbaton.frontend.metrics import FrontendMetrics
from kvbaton.frontend.models import ModelManager
from kvbaton.frontend.reasoning import ReasoningFormat
from kvbaton.frontend.response_store import DEFAULT_MAX_BYTES, StoredResponses
from kvbaton.frontend.settings import BusyThresholds, CanarySettings, MigrationSettings
from kvbaton.frontend.tool_calls import ToolCallFormat
from kvbaton.router import ReplicaSync, RouterMetrics, RouterSettings
from kvbaton.runtime import DistributedRuntime
from kvbaton.runtime.heap import trim_heap_every
from kvbaton.runtime.http_embed import EmbeddedUvicorn, bound, start_listening

log = logging.getLogger(__name__)

MODELS_LOAD_S = 30.0  # a listed model's tokenizer and router, at most, before listening


class FrontendServer:
    def __init__(
        self,
        runtime: DistributedRuntime,
        *,
        namespace: str,
        host: str = "127.0.0.1",
        port: int = 8000,
        max_body_bytes: int = 8 << 20,
        router: RouterSettings | None = None,
        migration: MigrationSettings | None = None,
        api_key: str | None = None,
        thresholds: BusyThresholds | None = None,
        canary: CanarySettings | None = None,
        reasoning: ReasoningFormat | None = None,
        tool_format: ToolCallFormat | None = None,
        reuse_port: bool = False,
        responses_store_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        """`reuse_port`: other processes (replicas) listen on the same port (SO_REUSEPORT).
        `api_key`: asked of every request but the probes' (none if None or empty).
        `reasoning`: split chat answers' reasoning from their content (None: no split).
        `tool_format`: how models write tool calls (None: as each one's chat template does).
        `responses_store_bytes`: the Responses API's responses kept here (0: none)."""
        self.runtime = runtime
        self.sync = ReplicaSync(runtime, namespace)  # with the other frontends of the namespace
        metrics = FrontendMetrics()
        self.models = ModelManager(
            runtime,
            namespace,
            router,
            RouterMetrics(metrics.registry),
            migration,
            thresholds,
            canary,
            self.sync,
        )
        self.stored = StoredResponses(runtime, namespace, responses_store_bytes)
        self.frontend = Frontend(self.models, metrics, reasoning, tool_format, self.stored)
        self.sock = bound(host, port, reuse_port=reuse_port)  # listening once models loaded
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        config = uvicorn.Config(
            RequestIdAndLimits(
                EndCutRequests(self.frontend.app, lambda: self.server.should_exit),
                max_body_bytes,
                api_key,
            ),
            http="httptools",
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=30,
            # In-flight requests get the runtime's drain time to end; then EndCutRequests.
            timeout_graceful_shutdown=math.ceil(runtime.settings.drain_timeout),
        )
        self.server = EmbeddedUvicorn(config)

    async def serve(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Serve until `stop()`; then close the model manager (the runtime is the caller's)."""
        await self.models.start()
        if not await self.models.loaded(MODELS_LOAD_S):
            log.warning("models still loading after %g s: serving meanwhile", MODELS_LOAD_S)
        await self.stored.start()  # (the ids of the responses kept here name this frontend)
        start_listening(self.sock)  # a replica gets connections once it knows the models
        trimming = asyncio.create_task(trim_heap_every())
        syncing = asyncio.create_task(self.sync.run())  # with the other frontends' routers
        keeping = asyncio.create_task(self.stored.run())  # and their kept responses
        try:
            if on_ready is not None:
                on_ready(self.url)
            await self.server.serve(sockets=[self.sock])
        finally:
            for task in (trimming, syncing, keeping):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.models.close()
            self.sock.close()

    def stop(self) -> None:
        self.server.should_exit = True
