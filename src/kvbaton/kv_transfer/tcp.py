"""KV blocks over TCP, for workers that cannot share memory: a small server per worker that
streams its pool's blocks out (READ) and receives blocks into it (WRITE), and the client calls.

A transfer is a header (4-byte big-endian length, then msgpack), an answer header, and the raw
bytes of the blocks in the order named (of each, the bytes `offset...offset + length` when the
header names a part: some layers), each block read from or written into the pool in place
(`recv_into` a run of consecutive blocks; `sendall` of a run). A client keeps its connections
open for the next transfer to the same peer (a connection and a server thread per transfer
cost more than moving a short prompt's KV), and retries once on a fresh connection when a kept
one fails. A transfer (from the client's connect, or the server's first read of its header, to
its last byte) has one deadline, `timeout_s`: each socket call gets the time left, so a peer
that trickles bytes cannot stretch it. The server's deadline is also at most the time the
client had left when it sent the header (from when it arrived): a write stops landing in the
server's pool at most the client's timeout after the client gave up on it. A bad header closes
the connection with an error answer."""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from kvbaton.kv_transfer.pool import KvPool, block_runs

log = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
MAX_HEADER = 16 << 20
CHUNK = 4 << 20  # bytes per send or receive call
MAX_IOV = 512  # views per vectored call (the system's limit is 1024)
IDLE_TIMEOUT_S = 300.0  # a kept connection with no transfer for this long is closed


class TransferRequest(msgspec.Struct, kw_only=True):
    op: str  # "read" or "write"
    layout: str
    blocks: list[int]
    offset: int = 0  # the part of each block moved; length None: from offset to its end
    length: int | None = None
    timeout_s: float | None = None  # the client's time left as it sent this: the server's too

    def span(self, block_bytes: int) -> slice:
        length = block_bytes - self.offset if self.length is None else self.length
        if self.offset < 0 or length <= 0 or self.offset + length > block_bytes:
            raise ValueError(f"bytes {self.offset}+{length} are not within a block")
        return slice(self.offset, self.offset + length)


class TransferAnswer(msgspec.Struct, kw_only=True):
    ok: bool
    error: str = ""


class _Timed:
    """A socket for one transfer: its calls share the deadline `started + timeout_s` (each gets
    the time left as its kernel timeout: Python's own socket timeouts poll before each call,
    which halved the rate measured); TimeoutError once it has passed."""

    def __init__(
        self, sock: socket.socket, timeout_s: float, what: str, started: float | None = None
    ) -> None:
        sock.settimeout(None)  # blocking: the kernel times each call out
        self.sock = sock
        self.timeout_s = timeout_s
        self.what = what
        self.deadline = (time.monotonic() if started is None else started) + timeout_s

    def _call(self, option: int, call: Callable[..., Any], *args: Any) -> Any:
        left = self.left()
        if left > 0:
            self.sock.setsockopt(socket.SOL_SOCKET, option, _timeval(left))
            try:
                return call(*args)
            except BlockingIOError:  # the kernel's timeout
                pass
        raise TimeoutError(f"{self.what}: not done after {self.timeout_s:g}s")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def shorten(self, seconds: float) -> None:
        """The deadline comes at the latest in `seconds`."""
        self.deadline = min(self.deadline, time.monotonic() + seconds)

    def sendall(self, data: bytes) -> None:
        """(Each send bounded: `socket.sendall` would give each of its sends the time left.)"""
        view = memoryview(data)
        while view:
            view = view[self.sendmsg([view]) :]

    def sendmsg(self, buffers: list[memoryview]) -> int:
        sent: int = self._call(socket.SO_SNDTIMEO, self.sock.sendmsg, buffers)
        return sent

    def recv_into(self, view: memoryview) -> int:
        got: int = self._call(socket.SO_RCVTIMEO, self.sock.recv_into, view)
        return got

    def recvmsg_into(self, buffers: list[memoryview]) -> int:
        got: int = self._call(socket.SO_RCVTIMEO, self.sock.recvmsg_into, buffers)[0]
        return got


def _send_header(sock: _Timed, message: msgspec.Struct) -> None:
    body = msgspec.msgpack.encode(message)
    sock.sendall(HEADER.pack(len(body)) + body)


def _recv_exact(sock: _Timed, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got : got + CHUNK])
        if n == 0:
            raise ConnectionError("the peer closed the KV transfer connection")
        got += n


def _recv_header(sock: _Timed, kind: type[msgspec.Struct]) -> msgspec.Struct:
    head = bytearray(HEADER.size)
    _recv_exact(sock, memoryview(head))
    (size,) = HEADER.unpack(head)
    if size > MAX_HEADER:
        raise ValueError(f"a KV transfer header of {size} bytes is over the limit")
    body = bytearray(size)
    _recv_exact(sock, memoryview(body))
    return msgspec.msgpack.decode(body, type=kind)


WHOLE = slice(None)


def _pieces(blocks: np.ndarray, ids: list[int], span: slice) -> deque[memoryview]:
    """The bytes `span` of blocks `ids` in order, in place: one view per run of consecutive
    blocks if whole, else one per block."""
    if span.indices(blocks.shape[1]) == (0, blocks.shape[1], 1):
        return deque(_bytes(blocks[start : start + n]) for start, _, n in block_runs(ids, ids))
    return deque(_bytes(blocks[b, span]) for b in ids)


def _batch(pieces: deque[memoryview]) -> list[memoryview]:
    """The next views for one vectored call, about CHUNK bytes (a piece may be split)."""
    batch: list[memoryview] = []
    size = 0
    while pieces and size < CHUNK and len(batch) < MAX_IOV:
        piece = pieces.popleft()
        if size + len(piece) > CHUNK:
            piece, rest = piece[: CHUNK - size], piece[CHUNK - size :]
            pieces.appendleft(rest)
        batch.append(piece)
        size += len(piece)
    return batch


def _advance(pieces: deque[memoryview], batch: list[memoryview], done: int) -> None:
    """Put back what a vectored call of `batch` left undone after `done` bytes."""
    for i, piece in enumerate(batch):
        if done < len(piece):
            pieces.extendleft(reversed([piece[done:], *batch[i + 1 :]]))
            return
        done -= len(piece)


def _send_blocks(sock: _Timed, blocks: np.ndarray, ids: list[int], span: slice) -> None:
    pieces = _pieces(blocks, ids, span)
    while pieces:
        batch = _batch(pieces)
        _advance(pieces, batch, sock.sendmsg(batch))


def _recv_blocks(sock: _Timed, blocks: np.ndarray, ids: list[int], span: slice) -> None:
    """Scattered blocks come in a few large reads, not one per block."""
    pieces = _pieces(blocks, ids, span)
    while pieces:
        batch = _batch(pieces)
        n = sock.recvmsg_into(batch)
        if n == 0:
            raise ConnectionError("the peer closed the KV transfer connection")
        _advance(pieces, batch, n)


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
        """Serve a connection's transfers, one after the other, until it closes or idles."""
        _tune(sock)
        while True:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(IDLE_TIMEOUT_S))
            try:
                head = sock.recv(HEADER.size, socket.MSG_PEEK)
            except OSError:
                return
            if not head:
                return  # the client closed it
            if not self._transfer(_Timed(sock, self.timeout_s, "a KV transfer served")):
                return

    def _transfer(self, sock: _Timed) -> bool:
        """One transfer; False when the connection is done with."""
        try:
            request = _recv_header(sock, TransferRequest)
            assert isinstance(request, TransferRequest)
            pool = self.pool
            if request.layout != pool.layout:
                raise ValueError(f"layout {request.layout!r} is not this pool's {pool.layout!r}")
            if request.op not in ("read", "write") or pool.blocks is None:
                raise ValueError(f"cannot {request.op!r} blocks of this pool")
            pool.check_blocks(request.blocks)
            span = request.span(pool.block_bytes)
            if request.timeout_s is not None:  # no bytes land here once the client gave up
                sock.shorten(request.timeout_s)
        except Exception as exc:
            log.warning("KV transfer refused: %s", exc)
            with contextlib.suppress(OSError):
                _send_header(sock, TransferAnswer(ok=False, error=str(exc)))
            return False
        try:
            _send_header(sock, TransferAnswer(ok=True))
            if request.op == "read":
                _send_blocks(sock, pool.blocks, request.blocks, span)
            else:
                _recv_blocks(sock, pool.blocks, request.blocks, span)
                _send_header(sock, TransferAnswer(ok=True))
            return True
        except (OSError, ConnectionError) as exc:
            log.warning("KV transfer broke off: %s", exc)
            return False

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class TcpClient:
    """Transfers with peers' servers over connections kept open between transfers."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()

    def read(
        self,
        address: str,
        layout: str,
        src: list[int],
        blocks: np.ndarray,
        dst: list[int],
        span: slice = WHOLE,
        started: Callable[[], None] = lambda: None,
    ) -> None:
        """Read the peer's blocks `src` into our `blocks[dst]` (in that order); of each block
        the bytes `span` (the same in both pools: their layouts are equal). `started` is
        called as the blocks' bytes begin to move."""

        def read(sock: _Timed) -> None:
            _send_header(sock, _request("read", layout, src, span, sock.left()))
            _expect_ok(sock, address)
            started()
            _recv_blocks(sock, blocks, dst, span)

        self._run(address, read)

    def write(
        self,
        address: str,
        layout: str,
        src: list[int],
        blocks: np.ndarray,
        dst: list[int],
        span: slice = WHOLE,
        started: Callable[[], None] = lambda: None,
    ) -> None:
        """Write our `blocks[src]` into the peer's blocks `dst` (in that order); of each block
        the bytes `span`. `started` is called as the blocks' bytes begin to move."""

        def write(sock: _Timed) -> None:
            _send_header(sock, _request("write", layout, dst, span, sock.left()))
            _expect_ok(sock, address)
            started()
            _send_blocks(sock, blocks, src, span)
            _expect_ok(sock, address)

        self._run(address, write)

    def _run(self, address: str, transfer: Callable[[_Timed], None]) -> None:
        with self._lock:
            idle = self._idle.get(address)
            kept = idle.pop() if idle else None
        for sock in ([kept] if kept else []) + [None]:
            started = time.monotonic()
            sock = sock or _connect(address, self.timeout_s)
            try:
                transfer(_Timed(sock, self.timeout_s, f"KV transfer with {address}", started))
            except (ConnectionError, OSError) as exc:
                sock.close()
                if sock is kept and not isinstance(exc, TimeoutError):
                    continue  # it idled out, or the peer restarted: once more, anew
                raise
            except BaseException:
                sock.close()
                raise
            with self._lock:
                self._idle.setdefault(address, []).append(sock)
            return

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                sock.close()


def _request(
    op: str, layout: str, blocks: list[int], span: slice, timeout_s: float
) -> TransferRequest:
    part = {} if span == WHOLE else {"offset": span.start, "length": span.stop - span.start}
    return TransferRequest(op=op, layout=layout, blocks=blocks, timeout_s=timeout_s, **part)


def _connect(address: str, timeout_s: float) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    _tune(sock)
    return sock


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _timeval(seconds: float) -> bytes:
    """`seconds` as a socket option's timeout (at least 1 ms: zero would mean never)."""
    return struct.pack("ll", *divmod(max(int(seconds * 1e6), 1000), 1_000_000))


def _expect_ok(sock: _Timed, address: str) -> None:
    answer = _recv_header(sock, TransferAnswer)
    assert isinstance(answer, TransferAnswer)
    if not answer.ok:
        raise RuntimeError(f"KV transfer server {address} refused: {answer.error}")
