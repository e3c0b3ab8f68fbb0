"""Load shedding: a request is not sent to a busy worker, and when every worker it could go to
is busy the frontend answers 503 with Retry-After at once, rather than queueing it without
bound.

A worker is busy when its KV blocks in use reach `BusyThresholds.kv_usage` of its pool, or its
prompt tokens waiting for prefill reach `prefill_tokens`. Each worker's load is its last
`load_metrics` answer (polled every `POLL_S`), plus the uncached prompt tokens this frontend sent it
since that answer whose prefill has not ended yet, so that a burst between two polls counts at once,
and a prompt already prefilled (or abandoned) does not count until the next answer. A worker whose
load is unknown (not yet polled, or no answer for `STALE_S`) is not busy: shedding never stops a
deployment that would otherwise serve.

A monitor follows one model's workers (its `members`): workers of other models that share the
component are neither asked nor kept.

Invariants: `LoadMonitor.close()` ends its tasks and client; `admit` returns the candidates
that are not busy, in their order (all of them without a monitor), and raises the 503 rather
than return none of a non-empty list.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Collection, Sequence

from kvbaton.frontend.errors import OpenAIError
from kvbaton.frontend.settings import BusyThresholds
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import Client, DistributedRuntime

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often each worker's load is asked for
ANSWER_S = 2.0  # a worker that takes longer keeps its last load (or none)
FRESH_S = 1.0  # a load older than this does not say a worker is working
STALE_S = 3.0  # nor, older than this, that it is busy: it is unknown


class LoadMonitor:
    """The loads of the workers of one component (`namespace.component`) that `members` names
    (asked at each poll; None: every worker of the component)."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        component: str,
        members: Callable[[], Collection[int]] | None = None,
    ) -> None:
        self.runtime = runtime
        self.endpoint = f"{component}.load_metrics"
        self.members = members
        self.loads: dict[int, WorkerLoad] = {}
        self._sent: dict[int, int] = {}  # worker -> prompt tokens sent since its last load
        self._at: dict[int, float] = {}  # worker -> when its last load came
        self._loads_seen: dict[int, int] = {}  # worker -> how many loads came (ends `_sent`'s)
        self._client: Client | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._client = await self.runtime.endpoint(self.endpoint).client(response_type=WorkerLoad)
        self._task = asyncio.create_task(self._poll())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    def working(self, worker: int) -> bool:
        """Its load, fresh (`FRESH_S`), has requests running or waiting (False if unknown)."""
        load = self.loads.get(worker)
        fresh = self.age(worker) <= FRESH_S
        return load is not None and fresh and (load.running > 0 or load.waiting > 0)

    def sent(self, worker: int, prompt_tokens: int) -> Callable[[], None]:
        """Count `prompt_tokens` as waiting at `worker` until its next load comes, or until the
        call returned (its prefill ended: first token, end or error), whichever is first. The
        call may be made any number of times."""
        self._sent[worker] = self._sent.get(worker, 0) + prompt_tokens
        seen = self._loads_seen.get(worker, 0)

        def prefilled() -> None:
            nonlocal prompt_tokens
            if prompt_tokens and self._loads_seen.get(worker, 0) == seen and worker in self._sent:
                self._sent[worker] -= prompt_tokens
            prompt_tokens = 0

        return prefilled

    def age(self, worker: int) -> float:
        """Seconds since `worker`'s last load came (inf: none came)."""
        return time.monotonic() - self._at.get(worker, -math.inf)

    def busy(self, worker: int, thresholds: BusyThresholds) -> bool:
        load = self.loads.get(worker)
        if load is None or self.age(worker) > STALE_S:
            return False
        kv, total = thresholds.kv_usage, load.kv_blocks_total
        if kv is not None and total and load.kv_blocks_used >= kv * total:
            return True
        prefill = thresholds.prefill_tokens
        waiting = load.active_prefill_tokens + self._sent.get(worker, 0)
        return prefill is not None and waiting >= prefill

    async def _poll(self) -> None:
        """Every `POLL_S`, ask each live member with no question pending (a slow one does not
        hold up the others)."""
        assert self._client is not None
        client = self._client
        asking: dict[int, asyncio.Task[None]] = {}
        try:
            while True:
                live = client.instance_ids()
                if self.members is not None:
                    members = self.members()
                    live = [worker for worker in live if worker in members]
                for gone in (set(self.loads) | set(self._sent)) - set(live):
                    self.loads.pop(gone, None)
                    self._sent.pop(gone, None)
                    self._at.pop(gone, None)
                    self._loads_seen.pop(gone, None)
                for worker in live:
                    if worker not in asking:
                        task = asyncio.create_task(self._ask(client, worker))
                        asking[worker] = task
                        task.add_done_callback(functools.partial(_forget, asking, worker))
                await asyncio.sleep(POLL_S)
        finally:
            pending = list(asking.values())
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _ask(self, client: Client, worker: int) -> None:
        with contextlib.suppress(Exception):  # no answer: the last load stands (or none)
            load: WorkerLoad = await anext(client.direct(None, worker, timeout=ANSWER_S))
            self.answered(worker, load)

    def answered(self, worker: int, load: WorkerLoad) -> None:
        """`load` came from `worker`: it counts every prompt that still waits there."""
        self.loads[worker] = load
        self._at[worker] = time.monotonic()
        self._sent.pop(worker, None)
        self._loads_seen[worker] = self._loads_seen.get(worker, 0) + 1


def _forget(asking: dict[int, asyncio.Task[None]], worker: int, _: object) -> None:
    asking.pop(worker, None)


def admit(
    monitor: LoadMonitor | None,
    thresholds: BusyThresholds,
    candidates: Sequence[int],
    what: str,
) -> list[int]:
    """The candidates that are not busy; if every one is, the 503 (`what`: "worker of model
    `m`", for its message)."""
    if monitor is None:
        return list(candidates)
    free = [w for w in candidates if not monitor.busy(w, thresholds)]
    if candidates and not free:
        raise OpenAIError(
            503,
            f"every {what} is busy; retry later",
            code="overloaded",
            type="server_error",
            headers={"retry-after": str(thresholds.retry_after_s)},
        )
    return free
