"""KV blocks over NIXL (the library Dynamo uses; UCX moves host memory between processes, and
GPU memory where there is one). Importing this module raises ImportError where NIXL is not
installed (`pip install kvbaton[nixl]`). The pool is host memory (DRAM); the published
metadata names the memory type and device, so that a pool in GPU memory (VRAM) needs only its
registration here.

One NIXL agent per pool. It registers the pool's memory once and publishes `metadata()`: its
NIXL agent metadata plus where the pool lies (address, size, memory type, device), which a
peer needs to name our blocks. A peer's agent is added lazily, on the first transfer with it,
and cached by its agent name; a peer that publishes new metadata under the same name is
re-added, and one whose transfer fails or times out is dropped (re-added on the next try)
once no other transfer with it is under way (NIXL would end those and free their handles
itself); a transfer meanwhile fails at once.

Each pool's blocks are prepared once as NIXL descriptor lists (`prep_xfer_dlist`, one
descriptor per block): ours when the agent starts, a peer's when it is added. A transfer is one
NIXL request made from block indices (`make_prepped_xfer`), which NIXL merges into the runs of
consecutive blocks: blocks are contiguous across all layers, so a request's KV moves in as many
pieces as it has runs. A transfer of some layers of each block (a part) moves one piece per
block, from descriptor lists made for it. READ and WRITE are one-sided; neither sends a
notification.

Progress: NIXL's own progress thread spins a core (its delay is 0), so the agent runs without
it, and a thread of ours progresses the agent every `progress_interval_s` (a peer's first
connection and UCX's TCP transport need the passive side to progress; shared memory and RDMA
do not). Transfers in flight are progressed by one poller thread (`nixl_poller.py`)."""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import msgspec
import numpy as np

from kvbaton.kv_transfer.nixl_poller import TransferPoller
from kvbaton.kv_transfer.pool import KvPool
from kvbaton.protocols.llm import KvPoolInfo

log = logging.getLogger(__name__)

# The `nixl` meta package picks the wheel that matches torch's CUDA; without it (the extra
# depends on `nixl-cu12` alone: the meta package requires every CUDA variant) import a variant.
_NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
PROGRESS_INTERVAL_S = 0.002
_MEMORY_TYPES = ("DRAM", "VRAM")
_BAD_METADATA = ("nixlMismatchError", "nixlInvalidParamError")  # add_remote_agent's answers


def _import_nixl() -> ModuleType:
    errors: list[str] = []
    for name in _NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name} ({exc})")
    raise ImportError("pip install 'kvbaton[nixl]'; tried " + ", ".join(errors))


_nixl = _import_nixl()
if not os.environ.get("NIXL_LOG_LEVEL"):
    # NIXL's Python logger prints each agent's start to stdout at INFO.
    logging.getLogger("nixl").setLevel(logging.WARNING)


class _Published(msgspec.Struct, kw_only=True):
    """What `metadata()` holds: the NIXL agent's metadata and the registered pool."""

    name: str  # the NIXL agent's name (also inside `agent`)
    agent: bytes  # nixl_agent.get_agent_metadata()
    mem: str  # "DRAM" (host memory) or "VRAM"
    device: int
    address: int
    nbytes: int


@dataclass(frozen=True)
class _Peer:
    name: str
    raw: bytes  # the metadata it was added from
    blocks: Any  # its blocks' prepared descriptor list
    address: int  # of its pool, registered as memory `mem` of `device`
    device: int
    mem: str


class NixlBackend:
    def __init__(
        self, pool: KvPool, name: str, progress_interval_s: float = PROGRESS_INTERVAL_S
    ) -> None:
        blocks = pool.blocks
        if blocks is None or pool.block_bytes == 0:
            raise ValueError("NIXL needs a KV pool with bytes in host memory")
        if not blocks.flags.c_contiguous:
            raise ValueError("NIXL needs the KV pool in one contiguous buffer")
        # Unique even if two processes pass the same name (a peer restarted, an id reused).
        self.name = f"{name}-{secrets.token_hex(4)}"
        self.block_bytes = pool.block_bytes
        self.num_blocks = pool.num_blocks
        self._blocks: np.ndarray | None = blocks  # keeps the memory mapped while registered
        self._address = int(blocks.ctypes.data)
        self._nbytes = int(blocks.nbytes)
        self._mem, self._device = "DRAM", 0
        self._lock = threading.Lock()  # the peer table, and adding or dropping a peer
        self._peers: dict[str, _Peer] = {}
        self._busy: dict[str, int] = {}  # peer name -> its transfers under way
        self._failing: set[str] = set()  # peers to drop once their transfers under way end
        self._unreleased: list[Any] = []  # transfer handles NIXL could not cancel
        self._closed = threading.Event()
        config = _nixl.nixl_agent_config(
            enable_prog_thread=False,
            backends=["UCX"],
            sync_mode=_nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # threads share it
        )
        self._agent: Any = _nixl.nixl_agent(self.name, config)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend here")
        region = np.array([[self._address, self._nbytes, self._device]], dtype=np.uint64)
        self._registered = self._agent.register_memory(region, self._mem)
        self._blocks_dlist = self._prep_blocks(
            "NIXL_INIT_AGENT", self._address, self.num_blocks, self._device, self._mem
        )
        self._metadata = msgspec.msgpack.encode(
            _Published(
                name=self.name,
                agent=self._agent.get_agent_metadata(),
                mem=self._mem,
                device=self._device,
                address=self._address,
                nbytes=self._nbytes,
            )
        )
        self._progress = threading.Thread(
            target=_progress_loop,
            args=(weakref.ref(self), self._closed, progress_interval_s),
            name=f"nixl-progress-{self.name}",
            daemon=True,
        )
        self._progress.start()
        self._poller = TransferPoller(self._agent, self.name)

    def metadata(self) -> bytes:
        """This agent's metadata, for peers to add it (published in `KvPoolInfo`)."""
        return self._metadata

    def read(
        self,
        peer: KvPoolInfo,
        src: list[int],
        dst: list[int],
        timeout_s: float,
        part: tuple[int, int] | None = None,
        started: Callable[[], None] = lambda: None,
    ) -> None:
        """Copy the peer's blocks `src` into ours `dst` (of each, the bytes (offset, length) of
        `part`, if given); blocks until done or raises. `started` is called as the transfer
        is posted (from then on bytes may move)."""
        self._transfer("READ", peer, dst, src, timeout_s, part, started)

    def write(
        self,
        peer: KvPoolInfo,
        src: list[int],
        dst: list[int],
        timeout_s: float,
        part: tuple[int, int] | None = None,
        started: Callable[[], None] = lambda: None,
    ) -> None:
        """Copy our blocks `src` into the peer's `dst` (of each, the bytes of `part`)."""
        self._transfer("WRITE", peer, src, dst, timeout_s, part, started)

    def close(self) -> None:
        """Drop the peers and the registration. Call once no transfer runs."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._poller.close()
        self._progress.join(timeout=5.0)
        agent, self._agent = self._agent, None
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
            self._busy.clear()
            self._failing.clear()
        for peer in peers:
            self._forget(agent, peer)
        for handle in self._unreleased:
            self._call_quietly(agent.release_xfer_handle, handle)
        self._unreleased.clear()
        self._call_quietly(agent.release_dlist_handle, self._blocks_dlist)
        self._call_quietly(agent.deregister_memory, self._registered)
        self._blocks = None

    # -- internals ---------------------------------------------------------------------------
    def _transfer(
        self,
        op: str,
        info: KvPoolInfo,
        ours: list[int],
        theirs: list[int],
        timeout_s: float,
        part: tuple[int, int] | None,
        started: Callable[[], None],
    ) -> None:
        if len(ours) != len(theirs):
            raise ValueError("as many source blocks as destination blocks")
        agent = self._agent
        if agent is None:
            raise RuntimeError("the NIXL backend is closed")
        if not ours:
            return
        if any(b < 0 or b >= self.num_blocks for b in ours):
            raise ValueError(f"block ids must be in [0, {self.num_blocks})")
        if any(b < 0 or b >= info.num_blocks for b in theirs):
            raise ValueError(f"the peer's block ids must be in [0, {info.num_blocks})")
        if part is not None and (part[0] < 0 or part[1] <= 0 or sum(part) > self.block_bytes):
            raise ValueError(f"bytes {part[0]}+{part[1]} are not within a block")
        failed = True
        peer = self._peer(info)  # (counted as busy until `_done_with`)
        try:
            what = f"NIXL {op} of {len(ours)} blocks with {peer.name}"
            try:
                if part is None:
                    handle = agent.make_prepped_xfer(
                        op,
                        self._blocks_dlist,
                        np.asarray(ours, dtype=np.int32),
                        peer.blocks,
                        np.asarray(theirs, dtype=np.int32),
                    )
                else:
                    local = self._parts(agent, self._address, ours, part, self._device, self._mem)
                    remote = self._parts(agent, peer.address, theirs, part, peer.device, peer.mem)
                    handle = agent.initialize_xfer(op, local, remote, peer.name)
            except Exception as exc:
                raise ConnectionError(f"{what}: {type(exc).__name__}: {exc}") from exc
            try:
                self._wait(agent, handle, what, timeout_s, started)
            finally:
                self._release(agent, handle, what)
            failed = False
        finally:  # a failed peer's connection may be broken: it is added anew next time
            self._done_with(peer, failed)

    def _wait(
        self, agent: Any, handle: Any, what: str, timeout_s: float, started: Callable[[], None]
    ) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            started()
            state = agent.transfer(handle)
        except Exception as exc:
            raise ConnectionError(f"{what}: {type(exc).__name__}: {exc}") from exc
        if state == "PROC":
            try:
                state = self._poller.wait(handle, deadline)
            except TimeoutError:
                raise TimeoutError(f"{what}: not done after {timeout_s:g}s") from None
            except Exception as exc:
                raise ConnectionError(f"{what}: {type(exc).__name__}: {exc}") from exc
        if state != "DONE":
            raise ConnectionError(f"{what} failed ({state})")

    def _release(self, agent: Any, handle: Any, what: str) -> None:
        """Free a transfer's handle; NIXL cancels one still in flight, or refuses."""
        try:
            agent.release_xfer_handle(handle)
        except Exception as exc:
            log.error("%s could not be cancelled (%s): its blocks may still change", what, exc)
            self._unreleased.append(handle)

    def _peer(self, info: KvPoolInfo) -> _Peer:
        """The peer's NIXL agent, added on first use."""
        raw = info.nixl_metadata
        if not raw:
            raise ValueError("the peer publishes no NIXL metadata")
        try:
            published = msgspec.msgpack.decode(raw, type=_Published)
        except msgspec.DecodeError as exc:
            raise ValueError(f"the peer's NIXL metadata is unreadable: {exc}") from exc
        if published.mem not in _MEMORY_TYPES:
            raise ValueError(f"the peer's NIXL memory type {published.mem!r} is unknown")
        if published.name == self.name:
            raise ValueError("the peer is this NIXL agent")
        if info.block_bytes != self.block_bytes:
            raise ValueError(
                f"the peer's blocks are {info.block_bytes} bytes, ours {self.block_bytes}"
            )
        if published.nbytes < info.num_blocks * info.block_bytes:
            raise ValueError("the peer registered less memory with NIXL than its pool holds")
        with self._lock:
            known = self._peers.get(published.name)
            if known is not None and known.raw == raw and known.name not in self._failing:
                self._busy[known.name] += 1
                return known
            if known is not None and self._busy[known.name]:  # failing, or new metadata
                raise ConnectionError(
                    f"NIXL peer {known.name} is being reset: its transfers under way end first"
                )
            agent = self._agent
            if agent is None:
                raise RuntimeError("the NIXL backend is closed")
            if known is not None:  # it published new metadata under the same name
                self._forget_locked(agent, known)
            try:
                loaded = agent.add_remote_agent(published.agent)
            except Exception as exc:
                problem = f"NIXL cannot add peer {published.name}: {type(exc).__name__}: {exc}"
                if type(exc).__name__ in _BAD_METADATA:
                    raise ValueError(problem) from exc
                raise ConnectionError(problem) from exc
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != published.name:
                self._call_quietly(agent.remove_remote_agent, loaded)
                raise ValueError(
                    f"the peer's NIXL metadata names agent {loaded!r}, not {published.name!r}"
                )
            try:
                blocks = self._prep_blocks(
                    published.name,
                    published.address,
                    info.num_blocks,
                    published.device,
                    published.mem,
                )
            except Exception as exc:
                self._call_quietly(agent.remove_remote_agent, published.name)
                raise ConnectionError(
                    f"NIXL cannot prepare peer {published.name}'s blocks: {exc}"
                ) from exc
            peer = _Peer(
                name=published.name,
                raw=raw,
                blocks=blocks,
                address=published.address,
                device=published.device,
                mem=published.mem,
            )
            self._peers[peer.name] = peer
            self._busy[peer.name] = 1
            return peer

    def _prep_blocks(self, agent_name: str, address: int, count: int, device: int, mem: str) -> Any:
        """The descriptor list of a pool's blocks (a strided list: `count` blocks of
        `block_bytes` from `address`), prepared for transfers with `agent_name`'s memory."""
        strided = np.array([[address, self.block_bytes, device, self.block_bytes, count]])
        return self._agent.prep_xfer_dlist(agent_name, strided.astype(np.uint64), mem)

    def _parts(
        self, agent: Any, address: int, ids: list[int], part: tuple[int, int], device: int, mem: str
    ) -> Any:
        """A descriptor list of the bytes `part` (offset, length) of each block `ids`."""
        starts = address + part[0] + np.asarray(ids, dtype=np.uint64) * np.uint64(self.block_bytes)
        descs = np.empty((len(ids), 3), dtype=np.uint64)
        descs[:, 0], descs[:, 1], descs[:, 2] = starts, part[1], device
        return agent.get_xfer_descs(descs, mem)

    def _done_with(self, peer: _Peer, failed: bool) -> None:
        """A transfer with `peer` ended. A failed one drops the peer, once no other transfer
        with it is under way: NIXL ends those (NIXL_ERR_NOT_FOUND) and frees their handles
        itself if their peer goes first."""
        with self._lock:
            if self._peers.get(peer.name) is not peer:
                return  # the backend closed
            self._busy[peer.name] -= 1
            if failed:
                self._failing.add(peer.name)
            if peer.name in self._failing and not self._busy[peer.name]:
                self._forget_locked(self._agent, peer)

    def _forget_locked(self, agent: Any, peer: _Peer) -> None:
        """(Holding `_lock`.)"""
        del self._peers[peer.name], self._busy[peer.name]
        self._failing.discard(peer.name)
        if agent is not None:
            self._forget(agent, peer)

    def _forget(self, agent: Any, peer: _Peer) -> None:
        self._call_quietly(agent.release_dlist_handle, peer.blocks)
        self._call_quietly(agent.remove_remote_agent, peer.name)

    @staticmethod
    def _call_quietly(call: Any, *args: Any) -> None:
        try:
            call(*args)
        except Exception as exc:
            log.debug("NIXL %s failed: %s", getattr(call, "__name__", call), exc)


def _progress_loop(
    backend_ref: weakref.ref[NixlBackend], closed: threading.Event, interval_s: float
) -> None:
    """Progress the backend's agent until it is closed (or collected: the thread holds it only
    weakly)."""
    failed = False
    while not closed.wait(interval_s):
        backend = backend_ref()
        agent = backend._agent if backend is not None else None
        del backend
        if agent is None:
            return
        try:
            agent.get_new_notifs()  # progresses the UCX worker; we send no notifications
        except Exception:
            if not failed:
                log.exception("NIXL progress failed (logged once)")
            failed = True
        del agent
