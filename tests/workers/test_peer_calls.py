"""A claim is accepted with the decode worker's promised wait (`wait_s`, the writer's bound); a
refusal, an acceptance with a bad wait (none: decode workers from before `wait_s` are no longer
served; not finite) or no answer closes the stream and gives None."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from kvbaton.disagg.peers import Claimed, PeerCalls
from kvbaton.protocols.disagg import KvClaim, KvClaimAnswer
from kvbaton.protocols.llm import KvPoolInfo, KvTarget
from kvbaton.runtime.request_plane.framing import payload_decoder

pytestmark = pytest.mark.unit


class FakeStream:
    """The claim's answers as the client decodes them (`KvClaimAnswer`: one amiss raises)."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.closed = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        if not self.answers:
            raise StopAsyncIteration
        answer = msgspec.msgpack.encode(self.answers.pop(0))
        return payload_decoder(KvClaimAnswer).decode(answer)

    async def aclose(self) -> None:
        self.closed = True


TARGET = KvTarget(
    decode_instance_id=1,
    decode_component="ns.backend",
    room="room",
    block_ids=[1],
    first_block=0,
    block_size=4,
    pool=KvPoolInfo(layout="test", num_blocks=8, block_bytes=0, host=""),
)


@pytest.mark.parametrize(
    "answers, wait_s",
    [
        ([{"accepted": True, "wait_s": 300.0}], 300.0),
        ([{"accepted": True, "wait_s": 120}], 120.0),
        # The old answer's `linger` flag (every decode worker takes a linger now) is ignored.
        ([{"accepted": True, "wait_s": 300.0, "linger": True}], 300.0),
        # From before wait_s: no longer accepted (there is no compatibility with it any more).
        ([{"accepted": True}], None),
        ([{"accepted": False}], None),
        ([{"accepted": True, "wait_s": 0}], None),
        ([{"accepted": True, "wait_s": float("nan")}], None),
        ([{"accepted": True, "wait_s": float("inf")}], None),
        ([{"accepted": True, "wait_s": True}], None),
        ([], None),
    ],
)
async def test_a_claim_counts_only_with_the_wait_it_was_promised(
    answers: list[Any], wait_s: float | None
) -> None:
    stream = FakeStream(list(answers))
    requests: list[KvClaim] = []

    def direct(request: KvClaim, instance_id: int) -> FakeStream:
        requests.append(request)
        return stream

    peers = PeerCalls(SimpleNamespace())  # type: ignore[arg-type]
    client: Any = SimpleNamespace(direct=direct)
    peers._clients["ns.backend.kv_claim", KvClaimAnswer] = client
    claim = await peers.claim(TARGET, 2.5)
    assert requests == [KvClaim(room="room", timeout_s=2.5)]
    if wait_s is None:
        assert claim is None and stream.closed
    else:
        assert claim == Claimed(stream, wait_s) and not stream.closed  # type: ignore[arg-type]
