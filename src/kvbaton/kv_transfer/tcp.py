"""KV blocks over TCP, for workers that cannot share memory: a small server per worker that
streams its pool's blocks out (READ) and receives blocks into it (WRITE), and the client calls.

A transfer is one connection: a header (4-byte big-endian length, then msgpack), an answer
header, and the raw bytes of the blocks in the order named, each block read from or written
into the pool in place (`recv_into` a run of consecutive blocks; `sendall` of a run). Every
socket operation has a timeout; a bad header closes the connection with an error answer."""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import struct
import threading

import msgspec
import numpy as np

from kvbaton.kv_transfer.pool import KvPool, block_runs

log = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
MAX_HEADER = 16 << 20
CHUNK = 4 << 20  # bytes per send or receive call


class TransferRequest(msgspec.Struct, kw_only=True):
    op: str  # "read" or "write"
    layout: str
    blocks: list[int]


class TransferAnswer(msgspec.Struct, kw_only=True):
    ok: bool
    error: str = ""


def _send_header(sock: socket.socket, message: msgspec.Struct) -> None:
    body = msgspec.msgpack.encode(message)
    sock.sendall(HEADER.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got : got + CHUNK])
        if n == 0:
            raise ConnectionError("the peer closed the KV transfer connection")
        got += n


def _recv_header(sock: socket.socket, kind: type[msgspec.Struct]) -> msgspec.Struct:
    head = bytearray(HEADER.size)
    _recv_exact(sock, memoryview(head))
    (size,) = HEADER.unpack(head)
    if size > MAX_HEADER:
        raise ValueError(f"a KV transfer header of {size} bytes is over the limit")
    body = bytearray(size)
    _recv_exact(sock, memoryview(body))
    return msgspec.msgpack.decode(body, type=kind)


def _send_blocks(sock: socket.socket, blocks: np.ndarray, ids: list[int]) -> None:
    for start, _, n in block_runs(ids, ids):
        view = _bytes(blocks[start : start + n])
        for offset in range(0, len(view), CHUNK):
            sock.sendall(view[offset : offset + CHUNK])


def _recv_blocks(sock: socket.socket, blocks: np.ndarray, ids: list[int]) -> None:
    for start, _, n in block_runs(ids, ids):
        _recv_exact(sock, _bytes(blocks[start : start + n]))


def _bytes(rows: np.ndarray) -> memoryview:
    """The bytes of a run of blocks, in place."""
    return memoryview(rows.data).cast("B")


class KvTransferServer:
    """Serves the pool's blocks on `host` (port 0: any free one) until `close`."""

    def __init__(self, pool: KvPool, host: str, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, 0), Handler)
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvbaton-kv-tcp", daemon=True
        )
        self._thread.start()

    def _handle(self, sock: socket.socket) -> None:
        sock.settimeout(self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            request = _recv_header(sock, TransferRequest)
            assert isinstance(request, TransferRequest)
            pool = self.pool
            if request.layout != pool.layout:
                raise ValueError(f"layout {request.layout!r} is not this pool's {pool.layout!r}")
            if request.op not in ("read", "write") or pool.blocks is None:
                raise ValueError(f"cannot {request.op!r} blocks of this pool")
            pool.check_blocks(request.blocks)
        except Exception as exc:
            log.warning("KV transfer refused: %s", exc)
            with contextlib.suppress(OSError):
                _send_header(sock, TransferAnswer(ok=False, error=str(exc)))
            return
        try:
            _send_header(sock, TransferAnswer(ok=True))
            if request.op == "read":
                _send_blocks(sock, pool.blocks, request.blocks)
            else:
                _recv_blocks(sock, pool.blocks, request.blocks)
                _send_header(sock, TransferAnswer(ok=True))
        except (OSError, ConnectionError) as exc:
            log.warning("KV transfer broke off: %s", exc)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _connect(address: str, timeout_s: float) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _expect_ok(sock: socket.socket, address: str) -> None:
    answer = _recv_header(sock, TransferAnswer)
    assert isinstance(answer, TransferAnswer)
    if not answer.ok:
        raise RuntimeError(f"KV transfer server {address} refused: {answer.error}")


def tcp_read(
    address: str, layout: str, src: list[int], blocks: np.ndarray, dst: list[int], timeout_s: float
) -> None:
    """Read the peer's blocks `src` into our `blocks[dst]` (in that order)."""
    with _connect(address, timeout_s) as sock:
        _send_header(sock, TransferRequest(op="read", layout=layout, blocks=src))
        _expect_ok(sock, address)
        _recv_blocks(sock, blocks, dst)


def tcp_write(
    address: str, layout: str, src: list[int], blocks: np.ndarray, dst: list[int], timeout_s: float
) -> None:
    """Write our `blocks[src]` into the peer's blocks `dst` (in that order)."""
    with _connect(address, timeout_s) as sock:
        _send_header(sock, TransferRequest(op="write", layout=layout, blocks=dst))
        _expect_ok(sock, address)
        _send_blocks(sock, blocks, src)
        _expect_ok(sock, address)
