"""Health canaries: an idle worker (this frontend has sent it nothing for `period_s`, and its
last reported load has nothing running or waiting) is asked a 1-token request; one whose canary
fails (an error, or no token within `timeout_s`) is unhealthy and passed over until a later
canary passes (all are tried when none is healthy). A hung engine is thus found while idle, not
by the next client's request; a busy worker is not judged by a canary that would wait behind
its queue.

Canaries go to the workers that run whole requests or decode (prefill workers would hold the
canary's KV for a decode worker that never comes; a failing prefill worker is already passed
over by the PrefillRouter's fallback).

Invariants: a canary never holds a slot past `timeout_s` (it is cancelled at its worker); at
most one canary per worker is in flight; a worker that leaves discovery is forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from kvbaton.frontend.settings import CanarySettings
from kvbaton.protocols.llm import PreprocessedRequest, SamplingParams
from kvbaton.runtime import Client

log = logging.getLogger(__name__)


class Canary:
    def __init__(
        self,
        client: Client,
        model: str,
        prompt: list[int],
        settings: CanarySettings,
        working: Callable[[int], bool] = lambda worker: False,
    ) -> None:
        """`client`: the model's `generate` endpoint; `prompt`: the canary's token ids;
        `working(worker)`: its last reported load has requests running or waiting."""
        self.client = client
        self.request = PreprocessedRequest(
            model=model, token_ids=prompt, sampling=SamplingParams(max_tokens=1, temperature=0)
        )
        self.period_s = settings.period_s
        self.timeout_s = settings.timeout_s
        self.working = working
        self.unhealthy: set[int] = set()
        self._last_used: dict[int, float] = {}  # worker -> when this frontend last sent it work
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def used(self, worker: int) -> None:
        """Work was sent to `worker`: no canary is needed for a while."""
        self._last_used[worker] = time.monotonic()

    def suspect(self, worker: int, why: str) -> None:
        """A request found `worker` silent: not routed to until its next canary passes."""
        if worker not in self.unhealthy:
            log.warning(
                "worker %x is suspect (%s): not routed to until it passes a canary", worker, why
            )
            self.unhealthy.add(worker)

    def unhealthy_live(self) -> set[int]:
        """The unhealthy workers still in discovery (`unhealthy` forgets one that left only at
        the canaries' next pass)."""
        return self.unhealthy & set(self.client.instance_ids())

    def healthy(self, candidates: Sequence[int]) -> list[int]:
        """The candidates not known to be unhealthy; all of them if none is healthy (a stale
        verdict should not refuse a request that a worker could serve)."""
        ok = [w for w in candidates if w not in self.unhealthy]
        return ok or list(candidates)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s / 4)
            live = self.client.instance_ids()
            for gone in set(self._last_used) - set(live):
                del self._last_used[gone]
            self.unhealthy &= set(live)
            now = time.monotonic()
            idle = [
                w
                for w in live
                if now - self._last_used.setdefault(w, now) >= self.period_s and not self.working(w)
            ]
            await asyncio.gather(*(self._probe(w) for w in idle))

    async def _probe(self, worker: int) -> None:
        self._last_used[worker] = time.monotonic()
        error = ""
        stream = self.client.direct(self.request, worker, timeout=self.timeout_s)
        try:
            async with asyncio.timeout(self.timeout_s):
                outputs = [out async for out in stream]
            if not any(out.token_ids for out in outputs):
                error = "it answered with no token"
        except TimeoutError:
            error = f"no answer within {self.timeout_s:g} s"
        except Exception as exc:  # any failure is the verdict
            error = f"{type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()
        if error and worker not in self.unhealthy:
            log.warning("worker %x failed its canary (%s): not routed to", worker, error)
            self.unhealthy.add(worker)
        elif not error and worker in self.unhealthy:
            log.info("worker %x passed its canary: routed to again", worker)
            self.unhealthy.discard(worker)
