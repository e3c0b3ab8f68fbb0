"""A claim is accepted with the decode worker's promised wait (`wait_s`, the writer's bound;
300 s from one that names none) and whether its reports take a linger; a refusal, an
acceptance with a bad wait (none, not finite) or no answer closes the stream and gives None."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvbaton.llm.peer_calls import Accepted, PeerCalls
from kvbaton.protocols.llm import KvPoolInfo, KvTarget

pytestmark = pytest.mark.unit


class FakeStream:
    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.closed = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        if not self.answers:
            raise StopAsyncIteration
        return self.answers.pop(0)

    async def aclose(self) -> None:
        self.closed = True


TARGET = KvTarget(
    decode_instance_id=1,
    claim_endpoint="ns.backend.kv_claim",
    notify_endpoint="ns.backend.kv_ready",
    room="room",
    block_ids=[1],
    first_block=0,
    block_size=4,
    pool=KvPoolInfo(layout="test", num_blocks=8, block_bytes=0, host=""),
)


@pytest.mark.parametrize(
    "answers, wait_s, takes_linger",
    [
        ([{"accepted": True, "wait_s": 300.0, "linger": True}], 300.0, True),
        ([{"accepted": True, "wait_s": 120}], 120.0, False),  # from before linger_s
        ([{"accepted": True}], 300.0, False),  # from before wait_s
        ([{"accepted": False}], None, False),
        ([{"accepted": True, "wait_s": 0}], None, False),
        ([{"accepted": True, "wait_s": float("nan")}], None, False),
        ([{"accepted": True, "wait_s": float("inf")}], None, False),
        ([{"accepted": True, "wait_s": True}], None, False),
        ([], None, False),
    ],
)
async def test_a_claim_counts_only_with_the_wait_it_was_promised(
    answers: list[Any], wait_s: float | None, takes_linger: bool
) -> None:
    stream = FakeStream(list(answers))
    requests: list[dict[str, Any]] = []

    def direct(request: dict[str, Any], instance_id: int) -> FakeStream:
        requests.append(request)
        return stream

    peers = PeerCalls(SimpleNamespace())  # type: ignore[arg-type]
    peers._clients[TARGET.claim_endpoint] = SimpleNamespace(direct=direct)  # type: ignore[assignment]
    claim = await peers.claim(TARGET, 2.5)
    assert requests == [{"room": "room", "timeout_s": 2.5}]
    if wait_s is None:
        assert claim is None and stream.closed
    else:
        assert claim == Accepted(stream, wait_s, takes_linger) and not stream.closed
