"""A decode worker's read of a prefill worker's KV (prefill-first) counts only if the prefill
worker held the blocks until the read ended: its hold may time out while the request queues on
the decode worker, and the blocks then go to another request. Otherwise the load fails and the
engine prefills the prompt itself. Either way one release goes out."""

from __future__ import annotations

import asyncio

import pytest

from kvbaton.engine.scheduler import KvLoad, KvLoadFailed
from kvbaton.protocols.llm import DisaggregatedParams
from kvbaton.workers.kv_handoff import KvFetch, KvHandoff
from tests.workers.fakes import POOL

pytestmark = pytest.mark.unit


class FakePeers:
    def __init__(self, held: bool) -> None:
        self.held = held
        self.released: list[str] = []

    async def release(self, params: DisaggregatedParams) -> bool:
        self.released.append(params.handle)
        return self.held

    async def close(self) -> None:
        pass


def fetch() -> KvFetch:
    params = DisaggregatedParams(
        prefill_instance_id=3,
        release_endpoint="ns.prefill.kv_release",
        handle="h",
        block_ids=[5, 6],
        num_tokens=8,
        block_size=4,
        first_token_ids=[42],
        pool=POOL,
    )
    return KvFetch(params)


@pytest.mark.parametrize("held", [True, False])
async def test_a_read_counts_only_if_the_blocks_were_held_until_it_ended(
    handoff: KvHandoff, held: bool
) -> None:
    peers = FakePeers(held)
    handoff.peers = peers  # type: ignore[assignment]
    source = fetch()
    load = asyncio.to_thread(handoff.load, KvLoad("r", source, 0, [1, 2]))
    if held:
        assert await load is None
        assert handoff.handoffs == 1
    else:
        with pytest.raises(KvLoadFailed, match="no longer held"):
            await load
        assert handoff.handoffs == 0
    assert handoff.agent.reads == [([5, 6], [1, 2])]  # type: ignore[attr-defined]
    assert peers.released == ["h"]
    assert not await handoff.release_remote(source)  # once
    assert peers.released == ["h"]
