"""Sans-IO framing of the request plane: pure functions and a push decoder, no sockets.

A frame on the wire is a 4-byte big-endian body length followed by the body, a msgpack-encoded
`kvbaton.protocols.frames.Frame`. A body over the size limit, a body that is not a frame, and
bytes left over when a connection closes are errors of that one connection.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import msgspec

from kvbaton.protocols.frames import Frame
from kvbaton.runtime.errors import FrameError

HEADER = struct.Struct(">I")
DATA_OVERHEAD = 16  # bytes a Data frame adds around its payloads, at most (tag, ids, lengths)
_encoder = msgspec.msgpack.Encoder()
_frame_decoder = msgspec.msgpack.Decoder(Frame)
_any_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder()


def encode_frame_into(frame: Frame, buf: bytearray, max_frame_bytes: int) -> None:
    """Append header and body of `frame` to `buf`; raises FrameError (leaving `buf` as it was)
    when the body is over the limit."""
    start = len(buf)
    _encoder.encode_into(frame, buf, start + HEADER.size)
    size = len(buf) - start - HEADER.size
    if size > max_frame_bytes:
        del buf[start:]
        raise FrameError(f"frame of {size} bytes is over the limit of {max_frame_bytes} bytes")
    HEADER.pack_into(buf, start, size)


def encode_frame(frame: Frame, max_frame_bytes: int) -> bytes:
    """Header and body of `frame`; raises FrameError when the body is over the limit."""
    buf = bytearray()
    encode_frame_into(frame, buf, max_frame_bytes)
    return bytes(buf)


def encode_payload(value: Any) -> msgspec.Raw:
    """A msgpack-encodable value (builtins or msgspec Structs) as a frame payload."""
    return msgspec.Raw(_encoder.encode(value))


@functools.lru_cache(maxsize=64)
def payload_decoder(type_: Any = Any) -> msgspec.msgpack.Decoder[Any]:
    """One decoder per response type (made once: a stream is opened per request)."""
    return _any_decoder if type_ is Any else msgspec.msgpack.Decoder(type_)


class FrameDecoder:
    """Turns received bytes into frames. After it raises, the connection must be closed."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._need = 0  # bytes the held-back frame needs in all (header included), once known

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held back; non-zero at close means a truncated frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        if self._buf:  # a held-back frame: gather its bytes, copy once when it is whole
            self._buf += data
            if len(self._buf) < self._need:
                return []
            data = bytes(self._buf)
            self._buf.clear()
        # Payloads (msgspec.Raw) keep a view of `data`: immutable bytes, so that is safe.
        view = memoryview(data)
        frames: list[Frame] = []
        pos, end = 0, len(data)
        while end - pos >= HEADER.size:
            (size,) = HEADER.unpack_from(data, pos)
            if size > self.max_frame_bytes:
                raise FrameError(
                    f"frame of {size} bytes is over the limit of {self.max_frame_bytes} bytes"
                )
            start = pos + HEADER.size
            if end - start < size:
                self._need = HEADER.size + size
                break
            try:
                frames.append(_frame_decoder.decode(view[start : start + size]))
            except msgspec.DecodeError as exc:
                raise FrameError(f"malformed frame: {exc}") from exc
            pos = start + size
        if pos < end:
            if end - pos < HEADER.size:
                self._need = HEADER.size
            self._buf += view[pos:]
        return frames
