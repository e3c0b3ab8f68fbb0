"""Compiled single-decode packages (compiled_decode.py) kept on disk: built once per model, block
size, machine and torch, then loaded in a second by every engine that runs the model.

- Packages live in `packages_dir()`. A package's name hashes what its build depends on
  (`PackageSpec`): the model's files (path, sizes, modification times), the dtype, the block
  size, the engine's torch threads, torch's version, the CPU, and the graph's source. A stale
  package is never loaded, only left behind.
- A build runs in a process of its own (`python -m kvbaton.engine.decode_package`), at a lower
  CPU priority: the engine serves eagerly meanwhile (`compile="auto"`), and the compiler's
  memory goes with the process. It says how long it has taken every half minute, and ends
  itself once the process that started it is gone.
- One build of a package at a time on a machine (`one_at_a_time`); written whole under a
  temporary name, then renamed: a package on disk is complete.
- Building needs a C++ compiler (Inductor's kernels are C++); loading does not.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbaton.llm.model_files import models_dir, one_at_a_time

log = logging.getLogger(__name__)

BUILD_WAIT_S = 3600.0  # for a build: minutes on a few cores, more for a larger model
STOP_WAIT_S = 10.0
BUILD_NICENESS = 10  # serving comes first where both want the CPU
PROGRESS_EVERY_S = 30.0
POLL_S = 0.5  # for a build's end


class BuildFailed(RuntimeError):
    """A package's build ended without the package."""


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


@dataclass(frozen=True)
class PackageSpec:
    """What a package is built for; `path` is where it lives on this machine."""

    model_dir: Path
    dtype: str
    block_size: int
    threads: int  # the engine's torch threads: Inductor splits its GEMMs for that many

    @property
    def path(self) -> Path:
        model_dir = self.model_dir.resolve()
        digest = hashlib.sha256()
        parts = (model_dir, self.dtype, self.block_size, self.threads, torch.__version__, _cpu())
        for part in parts:
            digest.update(f"{part}\0".encode())
        for file in sorted(model_dir.iterdir()):
            stat = file.stat()
            digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}\0".encode())
        for source in ("compiled_decode.py", "model.py"):
            digest.update(Path(__file__).with_name(source).read_bytes())
        name = f"{model_dir.name}-{self.dtype}-b{self.block_size}-t{self.threads}"
        return packages_dir() / f"{name}-{digest.hexdigest()[:16]}.pt2"


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
    from kvbaton.engine.model_runner import DTYPES

    path = spec.path
    path.parent.mkdir(parents=True, exist_ok=True)
    with one_at_a_time(path, "building", BUILD_WAIT_S, log.info):
        if path.is_file():
            return
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
            DTYPES[spec.dtype],
            torch.device("cpu"),
            config.max_len,
            "native",
        )
        partial = path.with_name(f".{path.stem}.{os.getpid()}.partial.pt2")
        try:
            export_package(model, spec.block_size, partial)
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
        log.info("built the compiled single-decode step in %.0f s", time.monotonic() - start)


class PackageBuild:
    """`build` of one package in a process of its own (see the module's docstring)."""

    def __init__(self, spec: PackageSpec) -> None:
        self.path = spec.path
        args = [spec.model_dir, spec.dtype, spec.block_size, spec.threads, os.getpid()]
        self._process = subprocess.Popen([sys.executable, "-m", __name__, *map(str, args)])

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


def _watch(parent: int, path: Path) -> None:
    """Exit this process once `parent` is gone (this process is re-parented); meanwhile, say how
    long the build has taken every `PROGRESS_EVERY_S`."""
    start = time.monotonic()

    def watch() -> None:
        said = start
        while os.getppid() == parent:
            time.sleep(1.0)
            if time.monotonic() - said >= PROGRESS_EVERY_S:
                said = time.monotonic()
                log.info("building %s: %.0f s so far", path.name, said - start)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main() -> None:
    parser = argparse.ArgumentParser(description="Build a compiled single-decode package.")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("dtype")
    parser.add_argument("block_size", type=int)
    parser.add_argument("threads", type=int)
    parser.add_argument("parent", type=int)
    args = parser.parse_args()
    spec = PackageSpec(args.model_dir, args.dtype, args.block_size, args.threads)
    _watch(args.parent, spec.path)
    os.nice(BUILD_NICENESS)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    build(spec)


if __name__ == "__main__":
    main()
