"""A decode worker's read of a prefill worker's KV (prefill-first) counts only if the prefill
worker held the blocks until the read ended: its hold may time out while the request queues on
the decode worker, and the blocks then go to another request. Otherwise the load fails and the
engine prefills the prompt itself. Either way one release goes out. A read that timed out over
a backend whose transfers may outlive their timeout (NIXL) keeps its blocks out of use until
then."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvbaton.disagg.decode_side import DecodeSide, KvFetch
from kvbaton.engine.connector import KvLoad, KvLoadFailed
from kvbaton.protocols.llm import DisaggregatedParams
from tests.workers.fakes import POOL, counted

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


def fetch(side: DecodeSide) -> KvFetch:
    params = DisaggregatedParams(
        prefill_instance_id=3,
        prefill_component="ns.prefill",
        handle="h",
        block_ids=[5, 6],
        num_tokens=8,
        block_size=4,
        first_token_ids=[42],
        pool=POOL,
    )
    return KvFetch(params, side)


@pytest.mark.parametrize("held", [True, False])
async def test_a_read_counts_only_if_the_blocks_were_held_until_it_ended(
    decode_side: DecodeSide, held: bool
) -> None:
    peers = FakePeers(held)
    decode_side.peers = peers  # type: ignore[assignment]
    source = fetch(decode_side)
    load = asyncio.to_thread(source.load, KvLoad("r", source, 0, [1, 2]))
    if held:
        assert await load == []
        assert decode_side.handoffs == 1
    else:
        with pytest.raises(KvLoadFailed, match="no longer held"):
            await load
        assert decode_side.handoffs == 0
    assert decode_side.agent.reads == [([5, 6], [1, 2])]  # type: ignore[attr-defined]
    assert peers.released == ["h"]
    assert await source.release() is None  # once
    assert peers.released == ["h"]
    assert counted(decode_side.reads_ended) == {"read" if held else "hold_ended": 1}


async def test_a_read_whose_request_ended_meanwhile_is_not_used(decode_side: DecodeSide) -> None:
    """The request's end released the blocks first (the client left during the read): the
    prefill worker's answer says nothing of the read, which is not used."""
    peers = FakePeers(held=True)
    decode_side.peers = peers  # type: ignore[assignment]
    source = fetch(decode_side)
    assert await source.release()  # (the request's end)
    with pytest.raises(KvLoadFailed, match="ended during the read"):
        await asyncio.to_thread(source.load, KvLoad("r", source, 0, [1, 2]))
    assert peers.released == ["h"] and decode_side.handoffs == 0
    assert counted(decode_side.reads_ended) == {"request_ended": 1}


@pytest.mark.parametrize("linger_s", [0.3, 0.0])
async def test_a_read_that_timed_out_keeps_its_blocks_out_while_it_may_land(
    decode_side: DecodeSide, linger_s: float
) -> None:
    def read(pool: object, src: list[int], dst: list[int]) -> str:
        raise TimeoutError("NIXL READ of 2 blocks: not done after 30s")

    decode_side.peers = FakePeers(held=True)  # type: ignore[assignment]
    decode_side.agent.read = read  # type: ignore[method-assign]
    decode_side.agent.linger_s = lambda pool, op: linger_s  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises((KvLoadFailed, TimeoutError), match="not done after 30s") as failed:
        source = fetch(decode_side)
        await asyncio.to_thread(source.load, KvLoad("r", source, 0, [1, 2]))
    assert counted(decode_side.reads_ended) == {"read_failed": 1}
    if not linger_s:  # the read stopped when the call did: the blocks are free at once
        assert not isinstance(failed.value, KvLoadFailed)
        return
    assert isinstance(failed.value, KvLoadFailed)
    writes_end = failed.value.writes_end
    assert writes_end is not None and not writes_end.is_set()
    reclaims = decode_side.engine.reclaims  # type: ignore[attr-defined]
    assert await asyncio.to_thread(writes_end.wait, 5.0)
    await asyncio.sleep(0)
    assert time.monotonic() - started >= linger_s and len(reclaims) == 1
