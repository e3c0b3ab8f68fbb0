"""One worker's KV transfer agent: reads blocks from a peer's pool into its own, or writes its
own into a peer's, over the best backend both can use.

Backends: `nixl` (the NIXL library, UCX underneath, where installed: the extra kvbaton[nixl]),
`shm` (same host: the peer's pool is a shared-memory segment, copied from or into in place),
`tcp` (any two hosts: the peer's transfer server), `none` (pools with no bytes, the mocker's:
nothing moves). `auto` picks shm when the peer is on this host and has a segment (a plain
memcpy: 2x NIXL's rate between two processes of one host, measured), else nixl when both
agents have it, else tcp; a forced backend that cannot reach the peer is an error."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

import numpy as np

from kvbaton.kv_transfer.pool import KvPool, attach_segment, block_runs, host_id
from kvbaton.kv_transfer.tcp import KvTransferServer, TcpClient
from kvbaton.protocols.llm import KvPoolInfo

if TYPE_CHECKING:
    from kvbaton.kv_transfer.nixl import NixlBackend

log = logging.getLogger(__name__)

BACKENDS = ("auto", "nixl", "shm", "tcp")
DEFAULT_TIMEOUT_S = 30.0


@dataclass
class TransferCounts:
    """An agent's reads and writes since it started (`KvTransferAgent.counts`)."""

    bytes_moved: int = 0
    seconds: float = 0.0
    bytes_by_backend: dict[str, int] = field(default_factory=dict)  # of `bytes_moved`
    layered_moves: int = 0  # of some layers of blocks (`layers` given)
    whole_blocks: int = 0  # blocks moved with all their layers at once


class KvTransferAgent:
    def __init__(
        self, pool: KvPool, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"KV transfer backend must be one of {', '.join(BACKENDS)}")
        self.pool = pool
        self.backend = backend
        self.timeout_s = timeout_s
        self._server: KvTransferServer | None = None
        self._nixl: NixlBackend | None = None
        self._tcp = TcpClient(timeout_s)
        self._info: KvPoolInfo | None = None
        self._peers: dict[str, tuple[shared_memory.SharedMemory, np.ndarray]] = {}
        self._lock = threading.Lock()
        self._moving = threading.local()  # `started`: this thread's last transfer moved bytes
        self._counts = TransferCounts()  # under `_lock`: transfers run on several threads

    def counts(self) -> TransferCounts:
        """Its counters, read together."""
        with self._lock:
            c = self._counts
            return replace(c, bytes_by_backend=dict(c.bytes_by_backend))

    def start(self, host: str, name: str = "") -> None:
        """Serve the pool over TCP on `host` (a pool with bytes, unless another backend is
        forced), and register it with NIXL (`name`: the agent's, unique) if that is installed
        and not ruled out."""
        self._info = None
        if self.pool.blocks is None:
            if self.backend in ("nixl", "shm") and self.pool.block_bytes:
                raise ValueError(f"{self.backend} needs the KV pool in host memory")
            return
        if self.backend in ("auto", "tcp"):
            self._server = KvTransferServer(self.pool, host, self.timeout_s)
        if self.backend in ("auto", "nixl"):
            try:
                from kvbaton.kv_transfer.nixl import NixlBackend

                self._nixl = NixlBackend(self.pool, name or f"kvbaton-{uuid.uuid4().hex}")
            except Exception as exc:  # not installed, or UCX would not start
                if self.backend == "nixl":
                    raise ValueError(f"--kv-transfer nixl: NIXL is unusable here ({exc})") from exc
                log.info("NIXL is unusable here (%s): KV moves over shm or tcp", exc)

    def info(self) -> KvPoolInfo:
        """How peers reach the pool (made once: it changes only at `start`)."""
        if self._info is None:
            self._info = self.pool.info(
                tcp_address=self._server.address if self._server else "",
                nixl_metadata=self._nixl.metadata() if self._nixl else b"",
            )
        return self._info

    def close(self) -> None:
        self._tcp.close()
        if self._server is not None:
            self._server.close()
        if self._nixl is not None:
            self._nixl.close()
        with self._lock:
            names = list(self._peers)
        for name in names:
            self._detach(name)

    def choose(self, peer: KvPoolInfo) -> str:
        """The backend for a transfer with `peer`; ValueError if none can work."""
        if peer.layout != self.pool.layout:
            raise ValueError(
                f"the peer's KV layout {peer.layout!r} differs from ours {self.pool.layout!r}"
            )
        if peer.block_bytes == 0 and self.pool.block_bytes == 0:
            return "none"
        if self.pool.blocks is None:
            raise ValueError("this worker's KV pool is not in host memory")
        same_host = peer.host == host_id() and bool(peer.shm_name)
        if self.backend == "shm" or (self.backend == "auto" and same_host):
            if not same_host:
                raise ValueError("shm needs a peer on this host with a shared-memory pool")
            return "shm"
        nixl = self._nixl is not None and bool(peer.nixl_metadata)
        if self.backend == "nixl" or (self.backend == "auto" and nixl):
            if not nixl:
                raise ValueError("nixl needs NIXL on both workers")
            return "nixl"
        if not peer.tcp_address:
            raise ValueError("the peer serves no KV over TCP")
        return "tcp"

    def linger_s(self, peer: KvPoolInfo, op: str) -> float:
        """How long after this thread's last transfer (`op`: "read" or "write") with `peer`
        failed (timed out or broke off) its bytes may still land: 0 if it failed before any
        could move (a connection or request refused, a peer NIXL would not add) or where this
        process moved them itself (shm, a tcp read: the copy stopped with the call);
        `timeout_s` for a tcp write (the peer's server takes bytes until the time this side
        had left when its header arrived); twice `timeout_s` over NIXL, which cancels the
        transfer and closes the peer's connection once its other transfers under way ended
        (within `timeout_s`), while a NIC may still complete a posted RDMA operation until that
        close has gone through."""
        if not getattr(self._moving, "started", False):
            return 0.0
        backend = self.choose(peer)
        if backend == "nixl":
            return 2 * self.timeout_s
        return self.timeout_s if backend == "tcp" and op == "write" else 0.0

    def read(
        self,
        peer: KvPoolInfo,
        src: list[int],
        dst: list[int],
        layers: tuple[int, int] | None = None,
    ) -> str:
        """Copy the peer's blocks `src` into ours `dst` (blocking); the backend used. With
        `layers` (first, end), only those layers of each block."""
        return self._move(peer, src, dst, "read", layers)

    def write(
        self,
        peer: KvPoolInfo,
        src: list[int],
        dst: list[int],
        layers: tuple[int, int] | None = None,
    ) -> str:
        """Copy our blocks `src` into the peer's `dst` (blocking); the backend used. With
        `layers` (first, end), only those layers of each block."""
        return self._move(peer, src, dst, "write", layers)

    def _move(
        self,
        peer: KvPoolInfo,
        src: list[int],
        dst: list[int],
        op: str,
        layers: tuple[int, int] | None,
    ) -> str:
        self._moving.started = False
        if len(src) != len(dst):
            raise ValueError("as many source blocks as destination blocks")
        backend = self.choose(peer)
        if not src or backend == "none":
            return backend
        offset, length = self.pool.byte_span(layers)
        ours, theirs = (dst, src) if op == "read" else (src, dst)
        self.pool.check_blocks(ours)
        if any(b < 0 or b >= peer.num_blocks for b in theirs):
            raise ValueError(f"the peer's block ids must be in [0, {peer.num_blocks})")
        blocks = self.pool.blocks
        assert blocks is not None
        started = time.perf_counter()
        span = slice(offset, offset + length)

        def moving() -> None:
            self._moving.started = True

        if backend == "shm":
            other = self._peer_blocks(peer)
            source, target = (other, blocks) if op == "read" else (blocks, other)
            moving()
            for s, d, n in block_runs(src, dst):
                target[d : d + n, span] = source[s : s + n, span]
        elif backend == "nixl":
            assert self._nixl is not None
            move = self._nixl.read if op == "read" else self._nixl.write
            part = None if layers is None else (offset, length)
            move(peer, src, dst, self.timeout_s, part, moving)
        elif op == "read":
            self._tcp.read(peer.tcp_address, peer.layout, src, blocks, dst, span, moving)
        else:
            self._tcp.write(peer.tcp_address, peer.layout, src, blocks, dst, span, moving)
        moved = len(src) * length
        with self._lock:
            c = self._counts
            c.seconds += time.perf_counter() - started
            c.bytes_moved += moved
            c.bytes_by_backend[backend] = c.bytes_by_backend.get(backend, 0) + moved
            if layers is None:
                c.whole_blocks += len(src)
            else:
                c.layered_moves += 1
        return backend

    def _peer_blocks(self, peer: KvPoolInfo) -> np.ndarray:
        with self._lock:
            entry = self._peers.get(peer.shm_name)
            if entry is None:
                nbytes = peer.num_blocks * peer.block_bytes
                segment, flat = attach_segment(peer.shm_name, nbytes)
                entry = (segment, flat.reshape(peer.num_blocks, peer.block_bytes))
                self._peers[peer.shm_name] = entry
            return entry[1]

    def _detach(self, shm_name: str) -> None:
        with self._lock:
            entry = self._peers.pop(shm_name, None)
        if entry is not None:
            segment = entry[0]
            del entry  # the last view of the segment, unless a copy still runs
            with contextlib.suppress(BufferError):
                segment.close()
