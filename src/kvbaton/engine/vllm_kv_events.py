"""The subscription to vLLM's KV cache events, feeding a `KvMirror` (`vllm_kv_mirror.py`).

- vLLM's engine process publishes its events on a ZMQ PUB socket bound to an ipc endpoint in
  the engine's private directory (`KVEventsConfig`; `vllm_engine.ipc_directory`); this process
  subscribes on its event loop, from before the first request. The vLLM reaper removes the
  directory.
- A batch's sequence number that skips (vLLM's publisher dropped batches at its high-water
  mark), or a batch that does not decode, clears the mirror (`KvMirror.lost`); so does a
  subscription that fails, which ends (logged).
- Only the device pool's events count (medium GPU, also on a CPU), of the first KV cache group
  (kvbaton serves models with one).
- vLLM and pyzmq are imported when the subscription starts, never at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import msgspec

from kvbaton.engine.vllm_kv_mirror import KvMirror

log = logging.getLogger(__name__)
ENDPOINT_NAME = "kv-events"


class VllmKvEvents:
    def __init__(self, directory: Path) -> None:
        self.endpoint = f"ipc://{directory / ENDPOINT_NAME}"
        self._task: asyncio.Task[None] | None = None

    def config(self) -> Any:
        """vLLM's KVEventsConfig publishing to `endpoint`."""
        from vllm.config.kv_events import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=self.endpoint)

    def start(self, mirror: KvMirror) -> None:
        self._task = asyncio.create_task(self._follow(mirror), name="vllm-kv-events")

    async def _follow(self, mirror: KvMirror) -> None:
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import (
            MEDIUM_GPU,
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
            KVEventBatch,
        )

        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        context = zmq.asyncio.Context()
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        expected = 0
        try:
            while True:
                _topic, seq, payload = await sock.recv_multipart()
                number = int.from_bytes(seq, "big")
                if number != expected:
                    mirror.lost(number - expected)
                expected = number + 1
                try:
                    batch = decode(payload)
                except msgspec.DecodeError as exc:
                    log.warning("KV events: a batch from vLLM does not decode (%s)", exc)
                    mirror.lost(1)
                    continue
                for event in batch.events:
                    if isinstance(event, AllBlocksCleared):
                        mirror.cleared()
                    elif event.medium not in (None, MEDIUM_GPU) or event.group_idx:
                        continue
                    elif isinstance(event, BlockStored):
                        mirror.stored(
                            event.block_hashes,
                            event.parent_block_hash,
                            event.token_ids,
                            event.block_size,
                            event.extra_keys,
                        )
                    elif isinstance(event, BlockRemoved):
                        mirror.removed(event.block_hashes)
        except Exception:  # no more removals would come: forget the blocks, never over-count
            log.exception("KV events from vLLM stopped; the router forgets this worker's blocks")
            mirror.cleared()
        finally:
            sock.close(linger=0)
            context.term()

    async def close(self) -> None:
        """End the subscription."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
