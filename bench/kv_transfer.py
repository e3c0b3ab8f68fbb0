"""KV transfer benchmark: a prompt's KV cache blocks moved between two worker processes with
each backend, beside the same run's memcpy bandwidth and a raw loopback socket.

    python bench/kv_transfer.py [--trials 5] [--sizes 512 4096 32768] [--backends shm tcp nixl]
                                [--block-size 16]

The KV is SmolLM2-135M's in bfloat16 (30 layers x K and V x 3 KV heads x head_dim 64: 23,040
bytes per token), laid out as the engine's cache blocks: with block size 16 a block is 368,640
bytes, contiguous across all layers. A second process (multiprocessing, spawn) plays the
prefill worker: it owns a `KvPool` in shared memory, filled with random bytes, its
`KvTransferAgent` serving TCP on 127.0.0.1, and sends its `KvPoolInfo` back over a pipe. This
process plays the decode worker, with a pool of its own, and for each prompt size and backend
- read (prefill-first: decode reads the prompt's blocks) and
- write (decode-first: prefill writes them into the blocks decode allocated)
through the real transfer layer (`KvTransferAgent.read` / `.write`), into destination blocks
scattered at random over the pool (one piece per block, as a busy cache hands them out) and
into consecutive ones (one piece in all). The source blocks are consecutive.

Baselines, measured in the same run, interleaved with the transfers:
- memcpy: numpy copying the same byte count within this process (what shm does at best);
- raw socket: the other process `sendall`s the same bytes in 4 MB chunks over a fresh loopback
  connection, received here by an asyncio BufferedProtocol into 4 MB buffers (the reference
  for the tcp backend, which also opens a connection per transfer);
- nixl raw (with nixl): NIXL's own API, as its benchmark uses it: an agent per process over the
  same pools (UCX, no progress thread: it would spin one of the cores all run long), the same
  bytes as one descriptor, the transfer handle made once, then posted and busy-polled to DONE.
Every figure is the median of --trials timed runs, after one untimed run per cell that also
checks the bytes arrived intact (the destination is first overwritten with the complement of
the source). Targets: shm >= 0.5x memcpy, tcp >= 0.7x the raw socket, nixl >= 1.0x nixl raw
(the same op). nixl is measured when `kvbaton.kv_transfer.nixl` imports and its agents start;
otherwise its rows say why not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.metadata
import math
import multiprocessing
import os
import platform
import signal
import socket
import statistics
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import headline
from kvbaton.kv_transfer import KvPool, KvTransferAgent
from kvbaton.kv_transfer.pool import attach_segment, block_runs
from kvbaton.protocols.llm import KvPoolInfo

# SmolLM2-135M: its KV per token, in bfloat16.
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 30, 3, 64, 2
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 23,040
CHUNK = 4 << 20  # the raw socket's send and receive size
HOST = "127.0.0.1"
TIMEOUT_S = 120.0
BACKENDS = ("shm", "tcp", "nixl")
TARGETS = {"shm": ("memcpy", 0.5), "tcp": ("raw socket", 0.7), "nixl": ("nixl raw", 1.0)}
BASELINES = ("memcpy", "raw socket", "nixl raw")
NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")  # as kvbaton's backend tries


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def layout_of(block_size: int) -> str:
    """`ModelRunner.kv_layout` of SmolLM2-135M in bfloat16."""
    return f"bfloat16:{LAYERS}x2x{block_size}x{KV_HEADS}x{HEAD_DIM}"


def fill_random(flat: np.ndarray, seed: int) -> None:
    """Random bytes into `flat` (uint8, length a multiple of 8), 64 MB at a time."""
    rng = np.random.default_rng(seed)
    words = flat.view(np.uint64)
    step = 8 << 20
    for start in range(0, len(words), step):
        n = min(step, len(words) - start)
        words[start : start + n] = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)


def new_pool(num_blocks: int, block_bytes: int, layout: str, seed: int) -> KvPool:
    """A pool in shared memory, as a worker's, filled with random bytes."""
    pool = KvPool(shared=True)
    buffer = pool.allocate(num_blocks * block_bytes)
    pool.attach(buffer, layout, num_blocks, block_bytes)
    del buffer
    assert pool.blocks is not None and pool.segment is not None, "no room in /dev/shm"
    fill_random(pool.blocks.reshape(-1), seed)
    return pool


def nixl_version() -> str:
    for name in ("nixl", "nixl-cu12", "nixl-cu13"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{name} {importlib.metadata.version(name)}"
    return ""


def nixl_missing() -> str:
    """Why nixl cannot be measured here ("" when its module imports)."""
    try:
        import kvbaton.kv_transfer.nixl  # noqa: F401
    except ImportError:
        return "not installed"
    return ""


def start_nixl(pool: KvPool, name: str) -> tuple[KvTransferAgent | None, str]:
    """A nixl agent over `pool`, or None and why not."""
    agent = KvTransferAgent(pool, "nixl", TIMEOUT_S)
    try:
        agent.start(HOST, name)
    except Exception as exc:
        with contextlib.suppress(Exception):
            agent.close()
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return None, reason if len(reason) <= 60 else reason[:57] + "..."
    return agent, ""


class RawNixl:
    """NIXL's API used directly over a pool's memory, for the raw baseline: one agent, the
    whole pool registered, no progress thread of NIXL's (the passive side runs a thread that
    progresses the agent every millisecond instead, which a peer's first connection needs)."""

    def __init__(self, blocks: np.ndarray, name: str, progress: bool) -> None:
        api: Any = None
        for module in NIXL_MODULES:
            with contextlib.suppress(ImportError):
                api = importlib.import_module(module)
                break
        if api is None:
            raise ImportError("no NIXL module")
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent: Any = api.nixl_agent(f"{name}-{os.getpid()}", config)
        self.address, self.nbytes = int(blocks.ctypes.data), int(blocks.nbytes)
        self.registered = self.agent.register_memory(self._descs(self.address, self.nbytes), "DRAM")
        self.handles: list[Any] = []
        self.peers: dict[bytes, str] = {}  # metadata: agent name
        self.closed = threading.Event()
        self.thread: threading.Thread | None = None
        if progress:
            self.thread = threading.Thread(target=self._progress, name="nixl-raw", daemon=True)
            self.thread.start()

    @staticmethod
    def _descs(address: int, nbytes: int) -> np.ndarray:
        return np.array([[address, nbytes, 0]], dtype=np.uint64)

    def _progress(self) -> None:
        while not self.closed.wait(0.001):
            self.agent.get_new_notifs()

    def published(self) -> tuple[bytes, int]:
        return self.agent.get_agent_metadata(), self.address

    def prepare(self, op: str, peer: tuple[bytes, int], nbytes: int) -> Any:
        """A READ or WRITE handle: our first `nbytes` bytes with the peer's."""
        metadata, address = peer
        name = self.peers.get(metadata)
        if name is None:
            added = self.agent.add_remote_agent(metadata)
            name = self.peers[metadata] = added.decode() if isinstance(added, bytes) else added
        local = self.agent.get_xfer_descs(self._descs(self.address, nbytes), "DRAM")
        remote = self.agent.get_xfer_descs(self._descs(address, nbytes), "DRAM")
        handle = self.agent.initialize_xfer(op, local, remote, name)
        self.handles.append(handle)
        return handle

    def run(self, handle: Any) -> None:
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended {state}")

    def close(self) -> None:
        self.closed.set()
        if self.thread is not None:
            self.thread.join(5)
        calls = [(self.agent.release_xfer_handle, h) for h in self.handles]
        calls += [(self.agent.remove_remote_agent, p) for p in self.peers.values()]
        calls.append((self.agent.deregister_memory, self.registered))
        for call, arg in calls:
            with contextlib.suppress(Exception):
                call(arg)
        self.handles.clear()


def start_raw_nixl(blocks: np.ndarray, name: str, progress: bool) -> tuple[RawNixl | None, str]:
    try:
        return RawNixl(blocks, name, progress), ""
    except Exception as exc:
        return None, f"raw NIXL: {type(exc).__name__}: {exc}"[:60]


# -- the other process: the prefill worker --------------------------------------------------


class RawSender:
    """Serves raw bytes on a loopback port: a connection sends an 8-byte big-endian length and
    gets that many bytes of `data` back, `sendall` of 4 MB chunks, then the connection closes."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.sock = socket.create_server((HOST, 0))
        self.port: int = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, name="raw-sender", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    head = b""
                    while len(head) < 8:
                        more = conn.recv(8 - len(head))
                        if not more:
                            raise ConnectionError("closed before the length")
                        head += more
                    (nbytes,) = struct.unpack(">Q", head)
                    for offset in range(0, nbytes, CHUNK):
                        conn.sendall(self.data[offset : min(offset + CHUNK, nbytes)])
                except OSError as exc:
                    say(f"raw sender: {exc}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.sock.close()
        self.thread.join(5)
        self.data.release()  # the pool's segment can close


def own_resource_tracker() -> None:
    """A spawned child shares its parent's resource tracker, and a peer attaching our segment
    (`attach_segment`) unregisters it there, so that our own unlink would then upset the
    tracker (and a crash of ours would leak the segment). Start one of our own, as a worker
    started by `kvbaton serve` has."""
    tracker: Any = resource_tracker._resource_tracker  # type: ignore[attr-defined]
    with contextlib.suppress(AttributeError):
        tracker._fd = None
        tracker._pid = None


def peer_main(conn: Connection, num_blocks: int, block_bytes: int, layout: str, nixl: bool) -> None:
    """The prefill worker: serve the pool until told to stop (or the parent goes away)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # cleanup below still runs
    own_resource_tracker()
    pool: KvPool | None = None
    agents: list[KvTransferAgent] = []
    raw: RawSender | None = None
    raw_nixl: RawNixl | None = None
    try:
        pool = new_pool(num_blocks, block_bytes, layout, seed=1)
        assert pool.blocks is not None
        tcp = KvTransferAgent(pool, "tcp", TIMEOUT_S)
        agents.append(tcp)
        tcp.start(HOST)
        # Each backend's KvPoolInfo (or why it did not start); nixl raw: (metadata, address).
        infos: dict[str, Any] = {"shm": pool.info(), "tcp": tcp.info()}
        if nixl:
            agent, why = start_nixl(pool, "kvbaton-bench-prefill")
            if agent is not None:
                agents.append(agent)
                infos["nixl"] = agent.info()
            else:
                infos["nixl"] = why
            raw_nixl, why = start_raw_nixl(pool.blocks, "kvbaton-bench-raw-prefill", True)
            infos["nixl raw"] = raw_nixl.published() if raw_nixl is not None else why
        raw = RawSender(memoryview(pool.blocks.reshape(-1)))
        conn.send((infos, raw.port))
        with contextlib.suppress(EOFError, OSError):
            while conn.recv() != "stop":
                pass
    finally:
        if raw is not None:
            raw.close()
        if raw_nixl is not None:
            raw_nixl.close()
        for agent in agents:
            agent.close()
        if pool is not None:
            pool.close()


# -- this process: the decode worker ---------------------------------------------------------


class RawReceiver(asyncio.BufferedProtocol):
    """Receives len(target) bytes into `target`, 4 MB buffers at a time."""

    def __init__(self, target: memoryview, done: asyncio.Future[None]) -> None:
        self.target = target
        self.done = done
        self.got = 0

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.got >= len(self.target):  # anything more is an error, caught below
            return memoryview(bytearray(CHUNK))
        return self.target[self.got : self.got + CHUNK]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got > len(self.target) and not self.done.done():
            self.done.set_exception(ValueError(f"{self.got} bytes, not {len(self.target)}"))
        elif self.got == len(self.target) and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError(f"closed after {self.got} bytes"))


async def raw_receive(port: int, target: memoryview) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    transport, _ = await loop.create_connection(lambda: RawReceiver(target, done), HOST, port)
    try:
        transport.write(struct.pack(">Q", len(target)))
        await done
    finally:
        transport.close()


@dataclass
class Cell:
    """One row of the table: what is timed, and how its bytes are checked."""

    path: str  # a backend, "memcpy" or "raw socket"
    op: str
    placement: str  # of the destination blocks: "scattered", "consecutive", "" for baselines
    pieces: int  # runs of blocks consecutive on both sides (what shm copies, nixl posts)
    run: Callable[[], None]
    check: Callable[[], bool]  # run once, with the bytes checked
    seconds: list[float] = field(default_factory=list)
    intact: bool = False
    note: str = ""  # why it was not measured

    def result(self) -> Result:
        return Result(
            self.path, self.op, self.placement, self.pieces, self.seconds, self.intact, self.note
        )


@dataclass
class Result:
    """What a cell measured, without its closures (which hold views of the pools)."""

    path: str
    op: str
    placement: str
    pieces: int
    seconds: list[float]
    intact: bool
    note: str

    def gbs(self, nbytes: int) -> float:
        return nbytes / statistics.median(self.seconds) / 1e9


def transfer_cell(
    path: str,
    op: str,
    placement: str,
    agent: KvTransferAgent,
    info: KvPoolInfo,
    ours: np.ndarray,
    theirs: np.ndarray,
    src: list[int],
    dst: list[int],
) -> Cell:
    """read: the peer's blocks `src` into ours `dst`; write: ours `src` into the peer's `dst`.
    `theirs` is a view of the peer's pool, only to check the bytes (never timed)."""
    move = agent.read if op == "read" else agent.write
    source, target = (theirs, ours) if op == "read" else (ours, theirs)
    runs = block_runs(src, dst)

    def run() -> None:
        used = move(info, src, dst)
        assert used == path, f"the agent used {used}, not {path}"

    def check() -> bool:
        for s, d, n in runs:  # the complement of the source: nothing left over can pass
            np.invert(source[s : s + n], out=target[d : d + n])
        run()
        return all(np.array_equal(target[d : d + n], source[s : s + n]) for s, d, n in runs)

    return Cell(path, op, placement, len(runs), run, check)


def memcpy_cell(nbytes: int) -> Cell:
    source = np.empty(nbytes, dtype=np.uint8)
    fill_random(source, seed=3)
    target = np.zeros(nbytes, dtype=np.uint8)  # touched: no page faults in the timed copies

    def run() -> None:
        np.copyto(target, source)

    def check() -> bool:
        np.invert(source, out=target)
        run()
        return bool(np.array_equal(target, source))

    return Cell("memcpy", "copy", "", 1, run, check)


def raw_cell(
    loop: asyncio.AbstractEventLoop, port: int, ours: np.ndarray, theirs: np.ndarray, nbytes: int
) -> Cell:
    source = theirs.reshape(-1)[:nbytes]
    target = ours.reshape(-1)[:nbytes]
    view = memoryview(target)

    def run() -> None:
        loop.run_until_complete(raw_receive(port, view))

    def check() -> bool:
        np.invert(source, out=target)
        run()
        return bool(np.array_equal(target, source))

    return Cell("raw socket", "recv", "", 1, run, check)


def raw_nixl_cell(
    raw: RawNixl,
    peer: tuple[bytes, int],
    op: str,
    ours: np.ndarray,
    theirs: np.ndarray,
    nbytes: int,
) -> Cell:
    handle = raw.prepare(op.upper(), peer, nbytes)
    source, target = (theirs, ours) if op == "read" else (ours, theirs)
    source, target = source.reshape(-1)[:nbytes], target.reshape(-1)[:nbytes]

    def run() -> None:
        raw.run(handle)

    def check() -> bool:
        np.invert(source, out=target)
        run()
        return bool(np.array_equal(target, source))

    return Cell("nixl raw", op, "consecutive", 1, run, check)


def measure(cells: list[Cell], trials: int, tokens: int, nbytes: int) -> None:
    """Check each cell once, then time them all, interleaved, `trials` times."""
    live = [c for c in cells if not c.note]
    for cell in live:
        cell.intact = cell.check()
        say(f"{tokens} tokens: {cell.path} {cell.op} {cell.placement}: intact={cell.intact}")
    for t in range(trials):
        for cell in live:
            started = time.perf_counter()
            cell.run()
            cell.seconds.append(time.perf_counter() - started)
        say(
            f"{tokens} tokens: trial {t + 1}/{trials}: "
            + ", ".join(
                f"{c.path} {c.op}{' ' + c.placement[:4] if c.placement else ''} "
                f"{nbytes / c.seconds[-1] / 1e9:.2f}"
                for c in live
            )
            + " GB/s"
        )


def start_agents(
    backends: list[str], pool: KvPool, infos: dict[str, Any], nixl_why: str
) -> tuple[dict[str, KvTransferAgent], str]:
    """This side's agent for each backend that can run, and why nixl cannot (if it cannot)."""
    agents: dict[str, KvTransferAgent] = {}
    for backend in backends:
        if backend != "nixl":
            agents[backend] = KvTransferAgent(pool, backend, TIMEOUT_S)
        elif not nixl_why and isinstance(infos.get("nixl"), str):
            nixl_why = infos["nixl"]  # the peer's nixl agent did not start
        elif not nixl_why:
            agent, nixl_why = start_nixl(pool, "kvbaton-bench-decode")
            if agent is not None:
                agents["nixl"] = agent
    return agents, nixl_why


def run_sizes(
    args: argparse.Namespace,
    loop: asyncio.AbstractEventLoop,
    pool: KvPool,
    theirs: np.ndarray,
    agents: dict[str, KvTransferAgent],
    infos: dict[str, Any],
    raw_port: int,
    nixl_why: str,
    raw_nixl: RawNixl | None,
) -> list[tuple[int, int, list[Result]]]:
    ours = pool.blocks
    assert ours is not None
    num_blocks, block_bytes = ours.shape
    rng = np.random.default_rng(4)
    rows = []
    for tokens in args.sizes:
        n = math.ceil(tokens / args.block_size)
        nbytes = n * block_bytes
        say(f"{tokens} tokens: {n} blocks, {nbytes / 1e6:.1f} MB")
        src = list(range(n))
        placements = {
            "scattered": [int(b) for b in rng.permutation(num_blocks)[:n]],
            "consecutive": list(range(n)),
        }
        cells = [memcpy_cell(nbytes), raw_cell(loop, raw_port, ours, theirs, nbytes)]
        if raw_nixl is not None:
            for op in ("read", "write"):
                cells.append(raw_nixl_cell(raw_nixl, infos["nixl raw"], op, ours, theirs, nbytes))
        for backend in args.backends:
            if backend not in agents:
                cells.append(Cell(backend, "", "", 0, lambda: None, lambda: False))
                cells[-1].note = f"n/a ({nixl_why})"
                continue
            for op in ("read", "write"):
                for placement, dst in placements.items():
                    cells.append(
                        transfer_cell(
                            backend, op, placement, agents[backend], infos[backend], ours,
                            theirs, src, dst,
                        )
                    )  # fmt: skip
        measure(cells, args.trials, tokens, nbytes)
        rows.append((tokens, nbytes, [c.result() for c in cells]))
        del cells  # the memcpy buffers go before the next size's
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[512, 4096, 32768], help="prompt tokens"
    )
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    args = parser.parse_args()
    if args.trials < 1 or args.block_size < 1 or min(args.sizes) < 1:
        parser.error("--trials, --block-size and --sizes must be positive")
    args.backends = list(dict.fromkeys(args.backends))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up as on Ctrl-C

    block_bytes = TOKEN_BYTES * args.block_size
    layout = layout_of(args.block_size)
    num_blocks = max(math.ceil(s / args.block_size) for s in args.sizes)
    nixl_why = nixl_missing() if "nixl" in args.backends else ""
    header = (
        f"KV transfer benchmark: SmolLM2-135M KV in bfloat16 ({TOKEN_BYTES:,} B/token), "
        f"block size {args.block_size} ({block_bytes:,} B/block), pools of {num_blocks:,} "
        f"blocks; {platform.machine()}, {multiprocessing.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, numpy {np.__version__}"
        f"{', ' + nixl_version() if 'nixl' in args.backends and not nixl_why else ''}; "
        f"{args.trials} trials, medians"
    )
    say(f"{header}; starting the peer process")

    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    peer_nixl = "nixl" in args.backends and not nixl_why
    child = ctx.Process(
        target=peer_main,
        args=(child_conn, num_blocks, block_bytes, layout, peer_nixl),
        name="kv-transfer-peer",
    )
    pool: KvPool | None = None
    segment: Any = None
    theirs: np.ndarray | None = None
    agents: dict[str, KvTransferAgent] = {}
    raw_nixl: RawNixl | None = None
    raw_nixl_why = ""
    loop = asyncio.new_event_loop()
    try:
        child.start()
        child_conn.close()
        deadline = time.monotonic() + 120
        while not conn.poll(0.5):
            if not child.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the peer process did not start (exit code {child.exitcode})")
        try:
            infos, raw_port = conn.recv()
        except EOFError:
            raise RuntimeError("the peer process failed (its error is above)") from None
        pool = new_pool(num_blocks, block_bytes, layout, seed=2)
        # A view of the peer's pool, to check bytes and overwrite destinations (never timed).
        segment, theirs = attach_segment(infos["shm"].shm_name, num_blocks * block_bytes)
        theirs = theirs.reshape(num_blocks, block_bytes)
        agents, nixl_why = start_agents(args.backends, pool, infos, nixl_why)
        if "nixl" in agents:
            if isinstance(infos["nixl raw"], str):
                raw_nixl_why = infos["nixl raw"]
            else:
                assert pool.blocks is not None
                raw_nixl, raw_nixl_why = start_raw_nixl(pool.blocks, "kvbaton-bench-raw", False)
        rows = run_sizes(args, loop, pool, theirs, agents, infos, raw_port, nixl_why, raw_nixl)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # their locals hold views of the pools
        raise
    finally:
        with contextlib.suppress(Exception):
            conn.send("stop")
        if child.pid is not None:
            child.join(30)
            if child.is_alive():
                child.terminate()
                child.join(10)
        if raw_nixl is not None:
            raw_nixl.close()
        for agent in agents.values():
            with contextlib.suppress(Exception):
                agent.close()
        loop.close()  # and any protocol still holding a view of our pool
        theirs = None
        if segment is not None:
            with contextlib.suppress(BufferError):
                segment.close()
        if pool is not None:
            pool.close()
    report(header, rows, raw_nixl_why)
    headlines(rows)


def headlines(rows: list[tuple[int, int, list[Result]]]) -> None:
    """Each backend measured: its read (prefill-first) into scattered blocks at the largest
    size run, against its baseline of the same size (nixl: NIXL's own read)."""
    tokens, nbytes, results = rows[-1]
    baselines = baselines_of(results, nbytes)
    met: bool | None
    print()
    for backend, (base, want) in TARGETS.items():
        cell = next(
            (
                r
                for r in results
                if (r.path, r.op, r.placement) == (backend, "read", "scattered") and not r.note
            ),
            None,
        )
        if cell is None:
            continue
        got, reference = cell.gbs(nbytes), reference_of(baselines, cell)
        ratio = got / reference if reference else None
        target, met = f"ratio at least {want:g}", None  # no baseline: no verdict
        if ratio is not None:
            target, met = headline.at_least(ratio, want)
        headline.report(
            "kv_transfer",
            f"{backend} read, {tokens:,} tokens, scattered blocks: {got:.2f} GB/s",
            f"{base} {reference:.2f} GB/s" if reference else f"{base}: not measured",
            ratio=ratio,
            target=target,
            met=met,
        )


def baselines_of(results: list[Result], nbytes: int) -> dict[str, float]:
    """One size's baselines in GB/s: memcpy and the raw socket by path, NIXL's own by op."""
    baselines = {r.path: r.gbs(nbytes) for r in results if r.path in BASELINES[:2]}
    baselines.update({r.op: r.gbs(nbytes) for r in results if r.path == "nixl raw"})
    return baselines


def reference_of(baselines: dict[str, float], result: Result) -> float | None:
    """The GB/s a backend's cell is judged against (None: a baseline or no baseline run)."""
    base, _ = TARGETS.get(result.path, ("", 0.0))
    return baselines.get(result.op if result.path == "nixl" else base)


def report(header: str, rows: list[tuple[int, int, list[Result]]], raw_nixl_why: str) -> None:
    print(header)
    print()
    print(
        "| tokens | MB | path | op | dst blocks | pieces | median ms | GB/s "
        "| ratio to baseline | target | intact |"
    )
    print("|---:|---:|---|---|---|---:|---:|---:|---:|---|---|")
    verdicts: dict[str, list[tuple[float, str]]] = {}
    for tokens, nbytes, results in rows:
        baselines = baselines_of(results, nbytes)
        for r in results:
            size = f"| {tokens:,} | {nbytes / 1e6:,.1f} | {r.path} "
            if r.note:
                print(f"{size}| | | | {r.note} | | | | |")
                continue
            gbs = r.gbs(nbytes)
            ratio = target = ""
            base, want = TARGETS.get(r.path, ("", 0.0))
            reference = reference_of(baselines, r)
            if r.path == "nixl" and reference is None:
                target = f"no raw baseline ({raw_nixl_why})"
            elif reference is not None:
                x = gbs / reference
                ratio = f"{x:.2f} x {base}"
                target = f">= {want}: {'met' if x >= want else 'MISSED'}"
                where = f"{tokens:,} tokens, {r.op}, {r.placement}"
                verdicts.setdefault(r.path, []).append((x, where))
            print(
                f"{size}| {r.op} | {r.placement} | {r.pieces} "
                f"| {statistics.median(r.seconds) * 1e3:,.2f} | {gbs:,.2f} | {ratio} | {target} "
                f"| {'yes' if r.intact else 'NO'} |"
            )
    print()
    for backend, found in verdicts.items():
        base, want = TARGETS[backend]
        met = sum(x >= want for x, _ in found)
        low, where = min(found)
        print(
            f"{backend}: >= {want}x {base} in {met} of {len(found)} cells "
            f"(lowest {low:.2f}x: {where})"
        )
    intact = all(r.intact for _, _, results in rows for r in results if not r.note)
    print(f"bytes verified intact in every measured cell: {'yes' if intact else 'NO'}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        say("interrupted")
        sys.exit(130)
