"""Compiled single-decode packages (compiled_decode.py) kept on disk: built once per model, block
size, machine and torch, then loaded in a second by every engine that runs the model.

- Packages live in `packages_dir()`. A package's name hashes what its build depends on: the
  model's files (path, sizes, modification times), the dtype, the block size, torch's version,
  the CPU and compiled_decode.py's source. A stale package is never loaded, only left behind.
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
from pathlib import Path

import torch

from kvbaton.llm.model_files import models_dir, one_at_a_time

log = logging.getLogger(__name__)

BUILD_WAIT_S = 3600.0  # for a build: minutes on a few cores, more for a larger model
STOP_WAIT_S = 10.0
BUILD_NICENESS = 10  # serving comes first where both want the CPU
PROGRESS_EVERY_S = 30.0


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


def package_path(model_dir: Path, dtype: str, block_size: int) -> Path:
    """Where the package of this model, dtype and block size lives on this machine."""
    model_dir = model_dir.resolve()
    digest = hashlib.sha256()
    for part in (str(model_dir), dtype, str(block_size), torch.__version__, _cpu()):
        digest.update(part.encode() + b"\0")
    for file in sorted(model_dir.iterdir()):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}\0".encode())
    digest.update(Path(__file__).with_name("compiled_decode.py").read_bytes())
    digest.update(Path(__file__).with_name("model.py").read_bytes())
    return packages_dir() / f"{model_dir.name}-{dtype}-b{block_size}-{digest.hexdigest()[:16]}.pt2"


def _cpu() -> str:
    """The CPU's model name and the vector instructions torch's kernels use on it."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{name.strip()} {torch.backends.cpu.get_cpu_capability()}"


def build(model_dir: Path, dtype: str, block_size: int, path: Path) -> None:
    """Build the package at `path` unless it is there (waiting for another process's build)."""
    from kvbaton.engine.compiled_decode import export_package
    from kvbaton.engine.model import LlamaModel, ModelConfig
    from kvbaton.engine.model_runner import DTYPES

    path.parent.mkdir(parents=True, exist_ok=True)
    with one_at_a_time(path, "building", BUILD_WAIT_S, log.info):
        if path.is_file():
            return
        start = time.monotonic()
        log.info(
            "building the compiled single-decode step of %s (minutes on a few cores) into %s",
            model_dir.name,
            path,
        )
        config = ModelConfig(model_dir)
        model = LlamaModel(
            model_dir, config, DTYPES[dtype], torch.device("cpu"), config.max_len, "native"
        )
        partial = path.with_name(f".{path.stem}.{os.getpid()}.partial.pt2")
        try:
            export_package(model, block_size, partial)
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
        log.info("built the compiled single-decode step in %.0f s", time.monotonic() - start)


class PackageBuild:
    """`build` of one package in a process of its own (see the module's docstring)."""

    def __init__(self, model_dir: Path, dtype: str, block_size: int, path: Path) -> None:
        self.path = path
        args = [str(model_dir), dtype, str(block_size), str(path), str(os.getpid())]
        self._process = subprocess.Popen([sys.executable, "-m", __name__, *args])

    def finished(self) -> bool:
        """Whether the package is built (its process may still be ending) or the build ended."""
        return self.path.is_file() or self._process.poll() is not None

    def wait(self, timeout: float = BUILD_WAIT_S) -> Path:
        """The package, once built; `BuildFailed` if the build failed or took over `timeout`."""
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise BuildFailed(f"building {self.path.name} took over {timeout:.0f} s") from None
        return self.result()

    def result(self) -> Path:
        """The package of a finished build; `BuildFailed` if there is none."""
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
    parser.add_argument("path", type=Path)
    parser.add_argument("parent", type=int)
    args = parser.parse_args()
    _watch(args.parent, args.path)
    os.nice(BUILD_NICENESS)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    build(args.model_dir, args.dtype, args.block_size, args.path)


if __name__ == "__main__":
    main()
