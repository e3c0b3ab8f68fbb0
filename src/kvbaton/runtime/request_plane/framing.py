"""Sans-IO framing of the request plane: pure functions and a push decoder, no sockets.

A frame on the wire is a 4-byte big-endian body length followed by the body, a msgpack-encoded
`kvbaton.protocols.frames.Frame`. A body over the size limit, a body that is not a frame, and
bytes left over when a connection closes are errors of that one connection.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from kvbaton.protocols.frames import Frame
from kvbaton.runtime.errors import FrameError

HEADER = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()
_frame_decoder = msgspec.msgpack.Decoder(Frame)
_any_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder()


def encode_frame(frame: Frame, max_frame_bytes: int) -> bytes:
    """Header and body of `frame`; raises FrameError when the body is over the limit."""
    buf = bytearray(HEADER.size)
    _encoder.encode_into(frame, buf, HEADER.size)
    size = len(buf) - HEADER.size
    if size > max_frame_bytes:
        raise FrameError(f"frame of {size} bytes is over the limit of {max_frame_bytes} bytes")
    HEADER.pack_into(buf, 0, size)
    return bytes(buf)


def encode_payload(value: Any) -> msgspec.Raw:
    """A msgpack-encodable value (builtins or msgspec Structs) as a frame payload."""
    return msgspec.Raw(_encoder.encode(value))


def payload_decoder(type_: Any = Any) -> msgspec.msgpack.Decoder[Any]:
    return _any_decoder if type_ is Any else msgspec.msgpack.Decoder(type_)


class FrameDecoder:
    """Turns received bytes into frames. After it raises, the connection must be closed."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held back; non-zero at close means a truncated frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        buf = self._buf
        buf += data
        frames: list[Frame] = []
        pos, end = 0, len(buf)
        while end - pos >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, pos)
            if size > self.max_frame_bytes:
                raise FrameError(
                    f"frame of {size} bytes is over the limit of {self.max_frame_bytes} bytes"
                )
            if end - pos - HEADER.size < size:
                break
            body = bytes(buf[pos + HEADER.size : pos + HEADER.size + size])
            try:
                frames.append(_frame_decoder.decode(body))
            except msgspec.DecodeError as exc:
                raise FrameError(f"malformed frame: {exc}") from exc
            pos += HEADER.size + size
        del buf[:pos]
        return frames
