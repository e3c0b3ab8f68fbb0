"""The echo worker: serves the runtime with no model, to try a deployment end to end and to
measure the request plane. `generate` streams `n` copies of the request; `stats` reports what
the worker saw (served, cancelled, in flight), so that tests can look inside another process."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from kvbaton.runtime import Context, DistributedRuntime


class EchoWorker:
    def __init__(self, runtime: DistributedRuntime, namespace: str, component: str) -> None:
        self.runtime = runtime
        self.component = runtime.namespace(namespace).component(component)
        self.served = 0
        self.cancelled = 0
        self.in_flight = 0

    async def generate(self, request: Any, context: Context) -> AsyncIterator[Any]:
        """Request: any value, or a dict with optional `n` (responses, default 1), `delay`
        (seconds before each), `fail` (raise ValueError with this text after the responses)."""
        options = request if isinstance(request, dict) else {}
        self.in_flight += 1
        try:
            for i in range(int(options.get("n", 1))):
                if options.get("delay"):
                    await asyncio.sleep(float(options["delay"]))
                if context.is_stopped():
                    self.cancelled += 1
                    return
                yield {
                    "i": i,
                    "echo": request,
                    "instance_id": self.runtime.instance_id,
                    "pid": os.getpid(),
                }
            if options.get("fail"):
                raise ValueError(str(options["fail"]))
            self.served += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1

    async def stats(self, request: Any, context: Context) -> dict[str, Any]:
        return {
            "served": self.served,
            "cancelled": self.cancelled,
            "in_flight": self.in_flight,
            "pid": os.getpid(),
            "instance_id": self.runtime.instance_id,
        }

    async def serve(self) -> None:
        await asyncio.gather(
            self.component.endpoint("generate").serve_endpoint(self.generate),
            self.component.endpoint("stats").serve_endpoint(self.stats),
        )
