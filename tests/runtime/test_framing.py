import asyncio
import itertools

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbaton.protocols.frames import Cancel, Data, End, Error, ErrorKind, Request
from kvbaton.runtime.errors import FrameError
from kvbaton.runtime.request_plane.connection import FrameConnection
from kvbaton.runtime.request_plane.framing import (
    HEADER,
    FrameDecoder,
    encode_frame,
    encode_payload,
)

pytestmark = pytest.mark.unit
LIMIT = 1 << 20

FRAMES = [
    Request(1, "ns.comp.ep", "req-1", encode_payload({"a": [1, 2, 3]}), 123.5),
    Request(2, "ns.comp.ep", "req-2", encode_payload("x")),
    Data(1, [encode_payload({"i": 0, "blob": b"\x00" * 100}), encode_payload(2)]),
    End(1),
    Error(2, ErrorKind.HANDLER, "boom", "ValueError"),
    Cancel(3),
]


def wire() -> bytes:
    return b"".join(encode_frame(f, LIMIT) for f in FRAMES)


def test_round_trip_in_one_piece() -> None:
    assert FrameDecoder(LIMIT).feed(wire()) == FRAMES


@given(st.lists(st.integers(min_value=0, max_value=len(wire())), max_size=20))
def test_any_split_of_the_bytes_gives_the_same_frames(cuts: list[int]) -> None:
    data, decoder, frames = wire(), FrameDecoder(LIMIT), []
    bounds = [0, *sorted(cuts), len(data)]
    for lo, hi in itertools.pairwise(bounds):
        frames += decoder.feed(data[lo:hi])
    assert frames == FRAMES
    assert decoder.buffered == 0


def test_a_partial_frame_is_held_back() -> None:
    data = encode_frame(End(7), LIMIT)
    decoder = FrameDecoder(LIMIT)
    assert decoder.feed(data[:-1]) == []
    assert decoder.buffered == len(data) - 1
    assert decoder.feed(data[-1:]) == [End(7)]


def test_oversized_header_is_refused_before_the_body_arrives() -> None:
    with pytest.raises(FrameError, match="over the limit"):
        FrameDecoder(1024).feed(HEADER.pack(1025))


def test_encoding_refuses_an_oversized_frame() -> None:
    with pytest.raises(FrameError, match="over the limit"):
        encode_frame(Data(1, [encode_payload(b"x" * 2048)]), 1024)


@pytest.mark.parametrize(
    "body",
    [b"\xc1", msgspec.msgpack.encode([99, 1]), msgspec.msgpack.encode({"a": 1}), b""],
    ids=["invalid-msgpack", "unknown-tag", "not-an-array", "empty"],
)
def test_malformed_body_is_an_error(body: bytes) -> None:
    with pytest.raises(FrameError, match="malformed"):
        FrameDecoder(LIMIT).feed(HEADER.pack(len(body)) + body)


def test_frames_ignore_unknown_trailing_fields() -> None:
    """A newer peer may append fields to a frame."""
    body = msgspec.msgpack.encode([2, 5, "extra"])
    assert FrameDecoder(LIMIT).feed(HEADER.pack(len(body)) + body) == [End(5)]


class RecordingTransport:
    """What a FrameConnection needs of its transport: it records each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))


async def test_outputs_sent_on_consecutive_turns_go_out_in_one_write() -> None:
    """A fast engine's next step lands on the next turn: its outputs join the same write, one
    Data frame per stream, and the write is made within two turns of the first output."""
    conn, transport = FrameConnection(LIMIT), RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.send_data(1, "a")
    await asyncio.sleep(0)
    conn.send_data(1, "b")
    conn.send_data(2, "c")
    assert transport.writes == []
    await asyncio.sleep(0)
    assert len(transport.writes) == 1
    assert FrameDecoder(LIMIT).feed(transport.writes[0]) == [
        Data(1, [encode_payload("a"), encode_payload("b")]),
        Data(2, [encode_payload("c")]),
    ]
