"""What both sides of disaggregation share: the engine, the KV transfer agent, the calls
to peers, the handoff counts a worker reports (`WorkerLoad`), and the request ends under way.

- Made on the event loop that serves the worker (`loop`).
- A request's end (reports, releases) runs to its end even if its caller is cancelled again
  (a drain's second cancellation); the worker waits for them before it stops.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any

from kvbaton.disagg.peers import PeerCalls
from kvbaton.engine.connector import ConnectedEngine, KvCacheView
from kvbaton.kv_transfer import KvTransferAgent
from kvbaton.runtime import DistributedRuntime


class Side:
    def __init__(
        self,
        runtime: DistributedRuntime,
        engine: ConnectedEngine,
        agent: KvTransferAgent,
        cache: KvCacheView,
        component: str,
        block_size: int,
    ) -> None:
        """`cache`: the engine's, whose blocks the agent's pool holds (or mirrors);
        `component`: "namespace.component" of this worker (its endpoints)."""
        self.runtime = runtime
        self.engine = engine
        self.agent = agent
        self.cache = cache
        self.component = component
        self.block_size = block_size
        self.peers = PeerCalls(runtime)
        self.handoffs = 0  # prompts whose KV was read or written here (see WorkerLoad)
        self.handoff_wait_s = 0.0
        self.ending: set[asyncio.Future[object]] = set()
        self._count_lock = threading.Lock()
        self.loop = asyncio.get_running_loop()

    async def close(self) -> None:
        await self.peers.close()
        await asyncio.to_thread(self.agent.close)

    def count_handoff(self, since: float) -> None:
        """A prompt's KV moved; it was waited for since `since` (perf_counter)."""
        with self._count_lock:
            self.handoffs += 1
            self.handoff_wait_s += time.perf_counter() - since

    async def shielded(self, ending: Coroutine[Any, Any, object]) -> None:
        """Run `ending` to its end, even if the caller is cancelled meanwhile."""
        future = asyncio.ensure_future(ending)
        self.ending.add(future)
        future.add_done_callback(self.ending.discard)
        await asyncio.shield(future)
