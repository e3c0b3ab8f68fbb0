"""A decode worker's rooms (decode-first): a prefill worker claims a room before it writes, and
holds the claim open until it reported. A room nobody claimed ends when its request ends, its
wait times out or the router abandons it, and refuses a claim from then on; a claimed room
waits for its writer's report or the end of its claim, past the end of its request, the first
timeout and the router's abandon. One that ends without the report tells the engine that writes
may still land in its blocks (`writes_end`, unset: the request computes its prompt in other
blocks), until a late report or the transfer timeout; either way the room is forgotten."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from kvbaton.disagg import peers as peer_calls
from kvbaton.disagg import rooms as rooms_module
from kvbaton.disagg.decode_side import DecodeSide
from kvbaton.disagg.peers import Claimed
from kvbaton.disagg.push import RoomClaim
from kvbaton.engine import AsyncEngine, SamplingParams
from kvbaton.engine.connector import EngineRequest, KvLoad, KvLoadFailed
from kvbaton.protocols.disagg import KvAbandon, KvClaim, KvReady
from kvbaton.runtime import Context
from kvbaton.runtime.request_plane.framing import payload_decoder
from tests.helpers import wait_until
from tests.workers.fakes import counted, make_decode_side

pytestmark = pytest.mark.unit


def received(type_: Any, request: object) -> Any:
    """`request` as the endpoint's server decodes it (it refuses one that is not a `type_`)."""
    return payload_decoder(type_).decode(msgspec.msgpack.encode(request))


async def admitted(side: DecodeSide, name: str) -> tuple[Any, asyncio.Task[list[int]]]:
    """A room whose blocks were announced, and the engine's load of its request waiting in it
    (on a load thread)."""
    room = side.open(name)
    load = asyncio.create_task(asyncio.to_thread(room.load, KvLoad(name, room, 0, [1, 2])))
    await asyncio.wait_for(room.announced, 5)
    target = side.target(room)
    assert (target.room, target.block_ids) == (name, [1, 2])
    return room, load


async def call(side: DecodeSide, **request: object) -> bool:
    """A report (`kv_ready`), or with `abandon` the router's abandon (`kv_abandon`)."""
    if request.pop("abandon", False):
        answer = await side.kv_abandon(received(KvAbandon, request), None)  # type: ignore[arg-type]
    else:
        answer = await side.kv_ready(received(KvReady, request), None)  # type: ignore[arg-type]
    return answer.accepted


@dataclass
class Claim:
    accepted: bool
    context: Context  # the claim stream's, on the decode worker
    held: asyncio.Task[list[object]]  # the rest of the stream: ends with the claim

    def let_go(self) -> None:
        """The writer closes its claim stream (or its connection goes)."""
        self.context.stop_generating()


async def claim(side: DecodeSide, name: str, timeout_s: float = 0.0) -> Claim:
    """A writer whose transfers end within `timeout_s` claims the room."""
    context = Context(f"{name}-claim")
    answers = side.kv_claim(received(KvClaim, {"room": name, "timeout_s": timeout_s}), context)
    first = await anext(answers)
    if first.accepted:  # the writer's bound: it writes nothing later than this after
        assert first.wait_s == peer_calls.CLAIMED_TIMEOUT_S

    async def rest() -> list[object]:
        return [answer async for answer in answers]

    return Claim(first.accepted, context, asyncio.create_task(rest()))


async def test_an_unclaimed_room_ends_with_its_request_and_refuses_a_claim(
    decode_side: DecodeSide,
) -> None:
    room, load = await admitted(decode_side, "r")
    decode_side.close_room(room)
    with pytest.raises(KvLoadFailed):
        await asyncio.wait_for(load, 2)
    assert "r" not in decode_side._rooms
    assert not (await claim(decode_side, "r")).accepted
    assert counted(decode_side.rooms_ended) == {"unclaimed": 1}


async def test_an_unclaimed_room_ends_at_its_timeout(decode_side: DecodeSide) -> None:
    _, load = await admitted(decode_side, "r")
    with pytest.raises(KvLoadFailed):
        await asyncio.wait_for(load, 3)
    assert not (await claim(decode_side, "r")).accepted
    assert counted(decode_side.rooms_ended) == {"unclaimed": 1}


async def test_a_claimed_room_waits_for_its_writer_after_its_request_ended(
    decode_side: DecodeSide,
) -> None:
    room, load = await admitted(decode_side, "r")
    writer = await claim(decode_side, "r")
    assert writer.accepted
    assert not (await claim(decode_side, "r")).accepted  # one writer
    decode_side.close_room(room)  # the client left; the prefill worker may still write
    await asyncio.sleep(1.0)  # twice the wait for a claim
    assert not load.done() and not writer.held.done()
    assert await call(decode_side, room="r", ok=False)
    with pytest.raises(KvLoadFailed):
        await asyncio.wait_for(load, 2)
    assert "r" not in decode_side._rooms
    assert await asyncio.wait_for(writer.held, 2) == []  # the room ended: so did the claim
    assert counted(decode_side.rooms_ended) == {"write_failed": 1}


async def test_a_claimed_room_takes_its_writers_tokens(decode_side: DecodeSide) -> None:
    _, load = await admitted(decode_side, "r")
    assert (await claim(decode_side, "r")).accepted
    await asyncio.sleep(0.7)  # past the wait for a claim
    assert await call(decode_side, room="r", ok=True, token_ids=[42])
    assert await asyncio.wait_for(load, 2) == [42]
    assert counted(decode_side.rooms_ended) == {"written": 1}


async def test_a_claimed_room_nobody_reports_on_ends_at_the_long_timeout(
    decode_side: DecodeSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peer_calls, "CLAIMED_TIMEOUT_S", 0.5)
    room, load = await admitted(decode_side, "r")
    writer = await claim(decode_side, "r")
    assert writer.accepted
    decode_side.close_room(room)
    with pytest.raises(KvLoadFailed) as failed:
        await asyncio.wait_for(load, 3)
    await asyncio.wait_for(writer.held, 2)  # the writer learns that nobody waits any more
    writes_end = failed.value.writes_end
    assert writes_end is not None and not writes_end.is_set()  # its blocks stay out of use
    assert not await call(decode_side, room="r", ok=True)  # a late report: the writes ended
    assert writes_end.is_set() and len(decode_side.engine.reclaims) == 1  # type: ignore[attr-defined]
    assert "r" not in decode_side._rooms
    assert counted(decode_side.rooms_ended) == {"writer_silent": 1}  # once, not at the late report


async def test_a_report_without_ok_is_refused(decode_side: DecodeSide) -> None:
    """A claim sent as a report (`kv_ready` with `claim`, as it once was) must not end the
    room as if the writer were done: its writes would land in blocks computed here."""
    room, load = await admitted(decode_side, "r")
    with pytest.raises(msgspec.ValidationError, match="`ok`"):
        await call(decode_side, room="r", claim=True)
    await asyncio.sleep(0.1)
    assert not load.done()
    decode_side.close_room(room)
    with pytest.raises(KvLoadFailed):
        await asyncio.wait_for(load, 2)


async def test_the_routers_abandon_ends_an_unclaimed_room(decode_side: DecodeSide) -> None:
    _, load = await admitted(decode_side, "r")
    assert await call(decode_side, room="r", abandon=True)
    with pytest.raises(KvLoadFailed):
        await asyncio.wait_for(load, 0.4)  # at once, not at the wait for a claim (0.5 s)
    assert "r" not in decode_side._rooms
    assert not (await claim(decode_side, "r")).accepted
    assert counted(decode_side.rooms_ended) == {"unclaimed": 1}


async def test_the_routers_abandon_leaves_a_claimed_room_to_its_writer(
    decode_side: DecodeSide,
) -> None:
    """The router gave up (its own timeout, or it lost the prefill worker's answer) while the
    writer may live on and write: the blocks wait for the writer, not for the router."""
    _, load = await admitted(decode_side, "r")
    writer = await claim(decode_side, "r")
    assert writer.accepted
    assert not await call(decode_side, room="r", abandon=True)
    await asyncio.sleep(0.7)  # past the wait for a claim
    assert not load.done() and not writer.held.done()
    assert await call(decode_side, room="r", ok=True, token_ids=[42])
    assert await asyncio.wait_for(load, 2) == [42]
    await asyncio.wait_for(writer.held, 2)


@pytest.mark.parametrize("writer_timeout_s", [0.0, 0.75])
async def test_a_claimed_room_ends_when_its_writer_lets_go_without_a_report(
    decode_side: DecodeSide, monkeypatch: pytest.MonkeyPatch, writer_timeout_s: float
) -> None:
    """The claim's end is the end of its writes: a prefill worker killed mid-prefill (its
    connection goes) frees the decode worker at once, with no report and no router."""
    monkeypatch.setattr(rooms_module, "WRITES_END_MARGIN_S", 0.1)
    _, load = await admitted(decode_side, "r")
    writer = await claim(decode_side, "r", writer_timeout_s)
    assert writer.accepted
    await asyncio.sleep(0.7)  # past the wait for a claim
    writer.let_go()
    let_go = time.monotonic()
    with pytest.raises(KvLoadFailed) as failed:
        await asyncio.wait_for(load, 2)
    await asyncio.wait_for(writer.held, 2)
    # The request goes on in other blocks; these wait out a write in flight (thrice the larger
    # of the two transfer timeouts, ours 0.5 s, plus the margin) unless the writer reports.
    writes_end = failed.value.writes_end
    assert writes_end is not None and not writes_end.is_set()
    assert await asyncio.to_thread(writes_end.wait, 5)
    (reclaimed,) = decode_side.engine.reclaims  # type: ignore[attr-defined]
    assert reclaimed - let_go >= 3 * max(0.5, writer_timeout_s) + 0.1 - 0.05
    assert "r" not in decode_side._rooms
    assert not await call(decode_side, room="r", ok=True, token_ids=[42])
    assert counted(decode_side.rooms_ended) == {"writer_lost": 1}


class FakeClaimStream:
    """A claim the decode worker accepted: it ends when `end` is set (the room ended there)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.end = asyncio.Event()

    def __aiter__(self) -> FakeClaimStream:
        return self

    async def __anext__(self) -> object:
        await self.end.wait()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.calls.append("let go")


class FakePeers:
    def __init__(self, wait_s: float) -> None:
        self.calls: list[str] = []
        self.stream = FakeClaimStream(self.calls)
        self.wait_s = wait_s

    async def claim(self, target: object, timeout_s: float) -> Claimed:
        assert timeout_s == 2.5  # the writer's transfer timeout
        return Claimed(self.stream, self.wait_s)  # type: ignore[arg-type]

    async def ready(self, target: object, report: KvReady) -> None:
        assert report.room == "r"
        linger = f" {report.linger_s:g}" if report.linger_s else ""
        self.calls.append(f"report {report.ok} {report.token_ids}{linger}")


def writer_claim(
    wait_s: float = 300.0, linger_s: float = 0.0
) -> tuple[RoomClaim, FakePeers, list[bool]]:
    peers, told = FakePeers(wait_s), []
    pusher = SimpleNamespace(
        claimed=told.append, agent=SimpleNamespace(timeout_s=2.5), linger_left=lambda: linger_s
    )
    target = SimpleNamespace(room="r")
    return RoomClaim(peers, target, pusher), peers, told  # type: ignore[arg-type]


async def test_a_writer_reports_before_it_lets_go_of_its_claim() -> None:
    made, peers, told = writer_claim()
    assert await made.accepted()
    await made.report(True, [42])
    await made.report(False, [])  # once
    assert peers.calls == ["report True [42]", "let go"]
    peers.stream.end.set()  # the room ended on the report
    await asyncio.sleep(0.05)
    assert told == [True]


async def test_a_writer_stops_writing_when_the_decode_worker_ends_its_claim() -> None:
    made, peers, told = writer_claim()
    assert await made.accepted()
    peers.stream.end.set()  # the decode worker stopped waiting (its long timeout)
    await asyncio.sleep(0.05)
    assert told == [True, False]
    await made.report(False, [])
    assert peers.calls == ["report False []", "let go"]


async def test_a_writer_stops_writing_once_the_wait_the_decode_worker_promised_ran_out() -> None:
    """No word of the claim's end reaches the writer (its request plane cut off): it stops
    on its own once the decode worker may have stopped waiting (the wait counts from before
    the claim was sent, so the writer's end comes first)."""
    made, peers, told = writer_claim(wait_s=0.2)
    assert await made.accepted()
    await asyncio.sleep(0.05)
    assert told == [True]
    await asyncio.sleep(0.3)
    assert told == [True, False]
    await made.report(False, [])
    assert peers.calls == ["report False []", "let go"]


async def test_a_writers_report_says_how_long_a_failed_write_may_still_land() -> None:
    made, peers, _ = writer_claim(linger_s=0.3)
    assert await made.accepted()
    await made.report(False, [])
    assert peers.calls == ["report False [] 0.3", "let go"]


async def test_a_report_says_its_linger_at_once_and_does_not_wait_it_out() -> None:
    """Every decode worker takes `linger_s` (no compatibility with one from before it any
    more): the report carries the linger and goes at once, it does not wait the linger out."""
    made, peers, _ = writer_claim(linger_s=0.3)
    assert await made.accepted()
    started = time.monotonic()
    await made.report(False, [])
    assert peers.calls == ["report False [] 0.3", "let go"]
    assert time.monotonic() - started < 0.3 - 0.05


async def test_a_report_with_a_linger_keeps_the_blocks_out_that_long(
    decode_side: DecodeSide,
) -> None:
    """A writer reports that a failed write may still land for a while (NIXL, or a TCP write
    the decode worker's own server takes): the request goes on in other blocks at once, and
    its blocks come back only after that."""
    _, load = await admitted(decode_side, "r")
    assert (await claim(decode_side, "r")).accepted
    reported = time.monotonic()
    assert await call(decode_side, room="r", ok=False, token_ids=[42], linger_s=0.3)
    with pytest.raises(KvLoadFailed) as failed:
        await asyncio.wait_for(load, 2)
    assert failed.value.token_ids == [42]
    writes_end = failed.value.writes_end
    assert writes_end is not None and not writes_end.is_set()
    assert await asyncio.to_thread(writes_end.wait, 5)
    (reclaimed,) = decode_side.engine.reclaims  # type: ignore[attr-defined]
    assert reclaimed - reported >= 0.3 - 0.05
    assert "r" not in decode_side._rooms


async def test_of_two_times_writes_may_land_until_the_later_counts(
    decode_side: DecodeSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim ended first (its writes may land for three times the timeout plus the margin,
    1.6 s here); a late report says a failed write may land for 2 s more: the blocks wait for
    that."""
    monkeypatch.setattr(rooms_module, "WRITES_END_MARGIN_S", 0.1)
    _, load = await admitted(decode_side, "r")
    writer = await claim(decode_side, "r")
    writer.let_go()
    with pytest.raises(KvLoadFailed) as failed:
        await asyncio.wait_for(load, 2)
    writes_end = failed.value.writes_end
    assert writes_end is not None
    assert not await call(decode_side, room="r", ok=False, token_ids=[], linger_s=2.0)  # (late)
    reported = time.monotonic()
    assert await asyncio.to_thread(writes_end.wait, 5)
    (reclaimed,) = decode_side.engine.reclaims  # type: ignore[attr-defined]
    assert reclaimed - reported >= 2.0 - 0.05


@pytest.mark.parametrize("linger_s", [-1, float("nan"), float("inf"), "1"])
async def test_a_report_with_a_bad_linger_is_refused(
    decode_side: DecodeSide, linger_s: object
) -> None:
    _, load = await admitted(decode_side, "r")
    assert (await claim(decode_side, "r")).accepted
    with pytest.raises(msgspec.ValidationError, match="linger_s"):
        await call(decode_side, room="r", ok=False, linger_s=linger_s)
    assert not load.done() and "r" in decode_side._rooms  # the room waits on
    assert await call(decode_side, room="r", ok=False)
    with pytest.raises(KvLoadFailed):
        await asyncio.wait_for(load, 2)


@pytest.mark.parametrize("request_", [None, {"room": 3}, {"room": "r", "timeout_s": float("nan")}])
async def test_a_bad_claim_is_refused_and_leaves_the_room_open(
    decode_side: DecodeSide, request_: object
) -> None:
    """(A writer timeout that is not a finite number would make the bound on its writes one.)"""
    _, load = await admitted(decode_side, "r")
    with pytest.raises(msgspec.ValidationError):  # by the server, before `kv_claim`
        await anext(decode_side.kv_claim(received(KvClaim, request_), Context("bad-claim")))
    assert (await claim(decode_side, "r")).accepted
    assert await call(decode_side, room="r", ok=False)
    with pytest.raises(KvLoadFailed):
        await asyncio.wait_for(load, 2)


async def test_a_request_cancelled_again_while_it_closes_still_closes_its_room(
    serving_engine: AsyncEngine,
) -> None:
    """A drain cancels a request's handler, then cancels again while it ends: its room still
    closes (no claim will come: an unclaimed room ends with its request)."""
    side = make_decode_side(5.0, serving_engine, serving_engine.engine.kv_cache(), 8)
    try:
        request = EngineRequest("r", list(range(5, 45)), SamplingParams(max_tokens=4))
        outputs = side.bootstrapped(request)
        first = await asyncio.wait_for(anext(outputs), 5)
        assert first.kv_target is not None and "r" in side._rooms
        closing = asyncio.create_task(outputs.aclose())
        await asyncio.sleep(0)  # it started closing
        closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        await wait_until(lambda: not side._rooms, 5, "the room closed")
    finally:
        await side.close()
