"""Compiled single-decode packages (compiled_decode.py) kept on disk: built once per model, block
size, machine and torch, then loaded in a few seconds by every engine that runs the model.

- Packages live in `packages_dir()`. A package's name hashes what its build depends on
  (`PackageSpec`): the model's files (path, sizes, modification times), the dtype, the block
  size, the engine's torch threads, torch's version, the CPU, and the graph's source. A stale
  package is never loaded.
- A package's modification time is when it was last looked up to load (`built_package`). A
  build removes the packages of its model and settings that other sources or another torch
  built and nothing has looked up for `STALE_S` (`remove_stale`), with their lock files.
- A build runs in a process of its own (`python -m kvbaton.engine.decode_package`), at a lower
  CPU priority: the engine serves eagerly meanwhile (`compile="auto"`), and the compiler's
  memory goes with the process. It says how long it has taken every half minute, and ends
  itself once the process that started it is gone.
- One build of a package at a time on a machine (`one_at_a_time`); written whole under a
  temporary name, then renamed: a package on disk is complete. A stopped build removes its
  temporary files; a killed one's are removed by the next build.
- Building needs a C++ compiler (Inductor's kernels are C++); loading does not.
- A package is loaded only where it fits (`check_fits`): its constants are copied into the
  process (about its size), and the machine, or the container, keeps `LOAD_MARGIN_BYTES`.
  Processes check and load a package in turns, under its lock (`load_fitting`): one that loads
  after another sees the memory that one took.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import errno
import functools
import glob
import hashlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch

from kvbaton.engine.config import BUILD_PROGRESS_S, BUILD_WAIT_S, EngineConfig
from kvbaton.llm.model_files import lock_file, models_dir, one_at_a_time

log = logging.getLogger("kvbaton.engine.decode_package")  # also when run as __main__
T = TypeVar("T")

STOP_WAIT_S = 10.0
BUILD_NICENESS = 10  # serving comes first where both want the CPU
POLL_S = 0.5  # for a build's end
LOAD_MARGIN_BYTES = 1 << 30  # of the available memory, left once a package is loaded
LOAD_WAIT_S = 600.0  # for the other processes' loads of a package before this one's
STALE_S = 7 * 86400.0  # unused this long, a package of other sources is removed by a build


class BuildFailed(RuntimeError):
    """A package's build ended without the package."""


class TooLargeToLoad(RuntimeError):
    """Loading a package would leave too little of the available memory."""


class LoadFailed(RuntimeError):
    """A package on disk did not load."""


def packages_dir() -> Path:
    """`$KVBATON_COMPILED_DIR`, else `compiled` beside the pulled models' directory."""
    if env := os.environ.get("KVBATON_COMPILED_DIR"):
        return Path(env).expanduser()
    return models_dir().parent / "compiled"


def cxx_compiler_missing() -> str | None:
    """Why a package cannot be built here, or None when a C++ compiler is found."""
    from torch._inductor import cpp_builder
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        cpp_builder.get_cpp_compiler()
    except InvalidCxxCompiler:
        return "building a compiled decode needs a C++ compiler (g++, or the one $CXX names)"
    return None


def available_memory(
    proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes this process may still take: the machine's available memory, or less where a
    cgroup v2 limit (a container's) leaves less; None where neither is known.

    - A cgroup's room is its `memory.max` less what it uses but the page cache it may drop
      (`inactive_file`), for its own cgroup and every one above it.
    - `proc` and `cgroups`: where procfs and the cgroup v2 tree are.
    """
    rooms = []
    with contextlib.suppress(OSError, ValueError, StopIteration), open(proc / "meminfo") as f:
        line = next(line for line in f if line.startswith("MemAvailable:"))
        rooms.append(int(line.split()[1]) * 1024)
    with contextlib.suppress(OSError, ValueError, StopIteration), open(proc / "self/cgroup") as f:
        own = next(line for line in f if line.startswith("0::")).strip()[3:]
        group = cgroups / own.lstrip("/")
        for cgroup in [group, *group.parents]:
            if not cgroup.is_relative_to(cgroups):
                break
            if (room := _cgroup_room(cgroup)) is not None:
                rooms.append(room)
    return min(rooms, default=None)


def _cgroup_room(cgroup: Path) -> int | None:
    """What a cgroup's memory limit leaves (see `available_memory`); None where it has none."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit == "max":
            return None
        room = int(limit) - int((cgroup / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    with contextlib.suppress(OSError, ValueError):
        for line in (cgroup / "memory.stat").read_text().splitlines():
            if line.startswith("inactive_file "):
                room += int(line.split()[1])
    return room


def load_fitting(
    path: Path, load: Callable[[Path], T], stopped: threading.Event | None = None
) -> T:
    """`load(path)`, where `check_fits(path)` passes.

    - One process of this machine at a time checks and loads the package (its lock): workers
      started together would each see the memory free, and each take it. In a directory it
      may not write (a read-only volume of packages), it loads without turns.
    - Nothing loads once `stopped` is set (BuildFailed), even after a wait for the turn.
    - A load that fails raises LoadFailed, which says to remove the package; a turn not had
      within `LOAD_WAIT_S`, TimeoutError.
    """
    with contextlib.ExitStack() as turn:
        try:
            turn.enter_context(one_at_a_time(path, "building or loading", LOAD_WAIT_S, log.info))
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            log.info("cannot lock %s (%s): loading it without turns", path.name, e)
        if stopped is not None and stopped.is_set():
            raise BuildFailed(f"stopped before loading {path.name}")
        check_fits(path)
        try:
            return load(path)
        except Exception as e:
            raise LoadFailed(f"{path} did not load ({e}); remove it to build it again") from e


def check_fits(path: Path) -> None:
    """`TooLargeToLoad` where loading the package at `path` would leave less than
    `LOAD_MARGIN_BYTES` of the available memory."""
    available, size = available_memory(), path.stat().st_size
    if available is not None and size + LOAD_MARGIN_BYTES > available:
        raise TooLargeToLoad(
            f"loading {path.name} takes {size / 2**30:.1f} GiB of memory and "
            f"{available / 2**30:.1f} GiB is available (at least "
            f"{LOAD_MARGIN_BYTES / 2**30:.0f} GiB is left to the rest)"
        )


@dataclass(frozen=True)
class PackageSpec:
    """What a package is built for; `path` is where it lives on this machine."""

    model_dir: Path
    dtype: str
    block_size: int
    threads: int  # the engine's torch threads: Inductor splits its GEMMs for that many

    @classmethod
    def of_engine(cls, model_dir: Path, config: EngineConfig) -> PackageSpec:
        """The package an engine of `config` on `model_dir` runs in this process."""
        return cls(model_dir, config.dtype, config.block_size, torch.get_num_threads())

    @functools.cached_property
    def path(self) -> Path:
        model_dir = self.model_dir.resolve()
        digest = hashlib.sha256()
        parts = (model_dir, self.dtype, self.block_size, self.threads, torch.__version__, _cpu())
        for part in parts:
            digest.update(f"{part}\0".encode())
        for file in sorted(model_dir.iterdir()):
            stat = file.stat()
            digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}\0".encode())
        for source in ("compiled_decode.py", "model.py", "decode_package.py"):
            digest.update(Path(__file__).with_name(source).read_bytes())
        name = f"{model_dir.name}-{self.dtype}-b{self.block_size}-t{self.threads}"
        return packages_dir() / f"{name}-{digest.hexdigest()[:16]}.so"


def _cpu() -> str:
    """The CPU's model name and the vector instructions torch's kernels use on it."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{name.strip()} {torch.backends.cpu.get_cpu_capability()}"


def build(spec: PackageSpec) -> None:
    """Build the package at `spec.path` unless it is there (waiting for another's build)."""
    from kvbaton.engine.compiled_decode import export_package
    from kvbaton.engine.model import LlamaModel, ModelConfig

    path = spec.path
    path.parent.mkdir(parents=True, exist_ok=True)
    with one_at_a_time(path, "building", BUILD_WAIT_S, log.info):
        if path.is_file():
            return
        for stale in path.parent.glob(f".{path.stem}.*.partial.*"):  # of a killed build
            stale.unlink(missing_ok=True)
        start = time.monotonic()
        log.info(
            "building the compiled single-decode step of %s (minutes on a few cores) into %s",
            spec.model_dir.name,
            path,
        )
        torch.set_num_threads(spec.threads)
        config = ModelConfig(spec.model_dir)
        model = LlamaModel(
            spec.model_dir,
            config,
            getattr(torch, spec.dtype),
            torch.device("cpu"),
            config.max_len,
            "native",
        )
        partial = path.with_name(f".{path.stem}.{os.getpid()}.partial{path.suffix}")
        try:
            export_package(model, spec.block_size, partial)
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
        log.info("built the compiled single-decode step in %.0f s", time.monotonic() - start)
        for removed in remove_stale(path):
            log.info("removed %s: built for other sources, unused for a week", removed.name)


def remove_stale(path: Path) -> list[Path]:
    """Remove the packages beside `path` of the same model and settings (its name but for the
    digest) that nothing has looked up for `STALE_S`, with their lock files; returns them."""
    stem = path.stem.rsplit("-", 1)[0]
    removed = []
    for other in path.parent.glob(f"{glob.escape(stem)}-*.so"):
        named = re.fullmatch(rf"{re.escape(stem)}-[0-9a-f]{{16}}\.so", other.name)
        with contextlib.suppress(FileNotFoundError):
            if other != path and named and time.time() - other.stat().st_mtime > STALE_S:
                other.unlink()
                lock_file(other).unlink(missing_ok=True)
                removed.append(other)
    return removed


class PackageBuild:
    """`build` of one package in a process of its own (see the module's docstring)."""

    def __init__(self, spec: PackageSpec) -> None:
        self.path = spec.path
        level = logging.getLevelName(log.getEffectiveLevel())
        args = [spec.model_dir, spec.dtype, spec.block_size, spec.threads, os.getpid(), level]
        # A session of its own: a Ctrl-C meant for the engine's process group is not its; it
        # ends itself once the engine's process is gone (`_watch`).
        self._process = subprocess.Popen(
            [sys.executable, "-m", "kvbaton.engine.decode_package", *map(str, args)],
            start_new_session=True,
        )

    def finished(self) -> bool:
        """Whether the package is built (its process may still be ending) or the build ended."""
        return self.path.is_file() or self._process.poll() is not None

    def wait(self, timeout: float = BUILD_WAIT_S) -> Path:
        """The package, once built; `BuildFailed` if the build ended without it or took over
        `timeout` (then it is stopped)."""
        deadline = time.monotonic() + timeout
        while not self.finished():
            if time.monotonic() > deadline:
                self.stop()
                raise BuildFailed(f"building {self.path.name} took over {timeout:.0f} s")
            time.sleep(POLL_S)
        if not self.path.is_file():
            code = self._process.poll()
            raise BuildFailed(f"building {self.path.name} failed (exit status {code})")
        return self.path

    def stop(self) -> None:
        """End the build process (it leaves no package) and reap it."""
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def built_package(spec: PackageSpec, started: Callable[[PackageBuild], None] | None = None) -> Path:
    """`spec`'s package, built first (`started(build)` then) where there is none; `BuildFailed`
    where it cannot be built. Its modification time is now: it is in use."""
    if spec.path.is_file():
        with contextlib.suppress(OSError):  # (a directory it may not write: kept all the same)
            os.utime(spec.path)
        return spec.path
    if missing := cxx_compiler_missing():
        raise BuildFailed(missing)
    build = PackageBuild(spec)
    if started is not None:
        started(build)
    return build.wait()


class PackageLoad(Generic[T]):
    """`load(path)` of `spec`'s package (`built_package`) on a thread of its own.

    - `future` ends with what `load` returned, or its exception (`BuildFailed` and
      `TooLargeToLoad` among them).
    - The thread holds what `load` holds, not its caller; a process that exits does not wait for
      it (a daemon), and the build process ends itself then.
    - `stop` ends a build under way; no load starts after it.
    """

    def __init__(self, spec: PackageSpec, load: Callable[[Path], T]) -> None:
        self.future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.build: PackageBuild | None = None  # the one started, if any
        self._stopped = threading.Event()
        args = (spec, load)
        threading.Thread(target=self._run, args=args, daemon=True, name="package-load").start()

    def _run(self, spec: PackageSpec, load: Callable[[Path], T]) -> None:
        try:
            path = built_package(spec, self._started)
            self.future.set_result(load_fitting(path, load, self._stopped))
        except Exception as e:  # the future carries it to the engine, which logs it
            self.future.set_exception(e)

    def _started(self, build: PackageBuild) -> None:
        self.build = build
        if self._stopped.is_set():
            build.stop()

    def stop(self) -> None:
        self._stopped.set()
        if self.build is not None:
            self.build.stop()


def _watch(parent: int, path: Path) -> None:
    """Exit this process once `parent` is gone (this process is re-parented); meanwhile, say how
    long the build has taken every `BUILD_PROGRESS_S`."""
    start = time.monotonic()

    def watch() -> None:
        said = start
        while os.getppid() == parent:
            time.sleep(1.0)
            if time.monotonic() - said >= BUILD_PROGRESS_S:
                said = time.monotonic()
                log.info("building %s: %.0f s so far", path.name, said - start)
        os.kill(os.getpid(), signal.SIGTERM)  # as `PackageBuild.stop` ends it

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main() -> None:
    parser = argparse.ArgumentParser(description="Build a compiled single-decode package.")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("dtype")
    parser.add_argument("block_size", type=int)
    parser.add_argument("threads", type=int)
    parser.add_argument("parent", type=int)
    parser.add_argument("log_level")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _exit_on_signal)  # a stopped build removes its partial file
    spec = PackageSpec(args.model_dir, args.dtype, args.block_size, args.threads)
    _watch(args.parent, spec.path)
    os.nice(BUILD_NICENESS)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    build(spec)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
