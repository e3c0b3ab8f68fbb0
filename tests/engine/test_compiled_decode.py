"""The compiled single-decode step (`--compile single-decode` and `auto`): greedy tokens equal HF
transformers' in float32 for every architecture, whether a step runs compiled (one decode alone)
or eagerly (a batch, a prefill, a context of one block); a package is built once per model and
loaded by the next engine, where it lies (a killed engine leaves no copy of it) and only where
it fits in memory; `auto` serves eagerly while its package builds in the background."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbaton.cli.worker import worker_compile
from kvbaton.engine import AsyncEngine, EngineConfig, LLMEngine, decode_package
from kvbaton.engine.compiled_decode import PROJECTIONS, CompiledDecode
from kvbaton.engine.decode_package import BuildFailed
from kvbaton.engine.model_runner import ModelRunner
from tests.engine.reference import engine, hf_greedy, prompts, run
from tests.helpers import clean_env, wait_until, wait_until_sync

BUILD_TIMEOUT_S = 600.0  # a tiny model's package: under a minute alone on 2 cores
LOAD_TIMEOUT_S = 120.0
# An engine that loads the package (argv: model, torch threads, a file to write once loaded),
# then waits to be killed.
LOADING_ENGINE = """
import sys, time, torch
from pathlib import Path
from tests.engine.reference import engine
model, threads, loaded = sys.argv[1:]
torch.set_num_threads(int(threads))
eng = engine(Path(model), compile="single-decode", device="cpu")
assert eng.stats().compiled_decode == "on"
open(loaded, "w").close()
time.sleep(600)
"""
REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.unit, pytest.mark.slow, pytest.mark.timeout(2 * BUILD_TIMEOUT_S)]


@pytest.fixture
def packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's packages directory (empty: every package is built here)."""
    monkeypatch.setenv("KVBATON_COMPILED_DIR", str(tmp_path))
    return tmp_path


def model_runner(eng: LLMEngine) -> ModelRunner:
    assert isinstance(eng.runner, ModelRunner)
    return eng.runner


@pytest.mark.parametrize("arch", ["llama-tied", "llama3-rope-untied", "qwen2-bias"])
def test_compiled_steps_give_hfs_tokens(
    tiny_models: dict[str, Path], packages: Path, arch: str
) -> None:
    model_dir = tiny_models[arch]
    expected = [hf_greedy(model_dir, tuple(p)) for p in prompts()]
    compiled = model_runner(engine(model_dir, compile="single-decode", device="cpu")).compiled
    assert isinstance(compiled, CompiledDecode)
    (package,) = packages.glob("*.so")
    built = package.stat().st_ino  # (a build writes a new file: its lookups touch this one)
    # Each projection's weight is in the package once: packed for Inductor's GEMM, or as given
    # where ATen's ran it. Kept as given besides: the norms, the embeddings (for the lookup),
    # the RoPE tables and the biases.
    layers = range(compiled.model.config.num_layers)
    norms = {f"{norm}_{i}" for norm in ("in_norm", "post_norm") for i in layers}
    biases = {f"qkv_bias_{i}" for i in layers if compiled.model.layers[i].qkv.bias is not None}
    projections = {f"{name}_{i}" for name in PROJECTIONS for i in layers} | {"lm_head"}
    made, given = constants(package)
    others = given - projections
    assert others == {"embed", "norm", "cos", "sin", *norms, *biases}
    assert len(made) + len(given & projections) == len(projections)
    # The next engine loads the package: no second build.
    eng = engine(model_dir, compile="single-decode", device="cpu")
    compiled = model_runner(eng).compiled
    assert isinstance(compiled, CompiledDecode) and compiled.path == package
    assert [run(eng, [p])[0] for p in prompts()] == expected
    assert compiled.steps > 40  # most decode steps of one sequence ran compiled
    steps = compiled.steps
    assert run(eng, prompts()) == expected  # batches run eagerly
    assert compiled.steps - steps < 12  # only the last sequence's last steps, if any
    assert list(packages.glob("*.so")) == [package]
    assert package.stat().st_ino == built


def constants(package: Path) -> tuple[set[str], set[str]]:
    """The package's constants by name: those Inductor made (such as a GEMM's packed weights,
    "constant<n>" and "constant<n>_<k>"), and those kept as the graph was given them."""
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(package), 1)
    names = set(runner.get_constant_names_to_original_fqns())
    made = {n for n in names if re.fullmatch(r"constant\d+(_\d+)?", n)}
    return made, names - made


def test_a_killed_engine_leaves_no_copy_of_its_package(
    tiny_models: dict[str, Path], packages: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_dir = tiny_models["llama-tied"]
    engine(model_dir, compile="single-decode", device="cpu")  # builds the package
    (package,) = packages.glob("*.so")
    temp = tmp_path_factory.mktemp("tmp")  # the engine's temporary directory
    loaded = tmp_path_factory.mktemp("signals") / "loaded"
    env = clean_env() | {"KVBATON_COMPILED_DIR": str(packages), "TMPDIR": str(temp)}
    args = [str(model_dir), str(torch.get_num_threads()), str(loaded)]
    child = subprocess.Popen([sys.executable, "-c", LOADING_ENGINE, *args], env=env, cwd=REPO)
    try:
        wait_until_sync(lambda: loaded.exists() or child.poll() is not None, LOAD_TIMEOUT_S)
        assert loaded.exists(), f"the engine exited with {child.returncode} before loading"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert list(packages.glob("*.so")) == [package]  # loaded, not built again
    assert list(temp.iterdir()) == []  # nothing of it left in the temporary directory


def test_a_package_is_loaded_only_where_it_fits_in_memory(
    tiny_models: dict[str, Path], packages: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_models["llama-tied"]
    available = decode_package.available_memory()
    assert available is not None and available > 0  # /proc/meminfo, or the cgroup's limit
    engine(model_dir, compile="single-decode", device="cpu")  # builds the package: it fits
    (package,) = packages.glob("*.so")
    short = decode_package.LOAD_MARGIN_BYTES + package.stat().st_size - 1
    monkeypatch.setattr(decode_package, "available_memory", lambda: short)
    with pytest.raises(ValueError, match="GiB is available"):
        engine(model_dir, compile="single-decode", device="cpu")
    eng = engine(model_dir, compile="auto", device="cpu")
    load = model_runner(eng).compiling
    assert load is not None
    wait_until_sync(load.future.done, BUILD_TIMEOUT_S, "the package's load")
    assert isinstance(load.future.exception(), decode_package.TooLargeToLoad)
    assert run(eng, prompts()) == [hf_greedy(model_dir, tuple(p)) for p in prompts()]
    assert model_runner(eng).compiled is None and eng.stats().compiled_decode == "failed"


def test_auto_serves_eagerly_until_its_package_is_built(
    tiny_models: dict[str, Path], packages: Path
) -> None:
    model_dir = tiny_models["llama-tied"]
    expected = [hf_greedy(model_dir, tuple(p)) for p in prompts()]
    eng = engine(model_dir, compile="auto", device="cpu")
    runner = model_runner(eng)
    load = runner.compiling
    assert load is not None and eng.stats().compiled_decode == "loading"
    assert run(eng, prompts()) == expected  # eagerly, while the package builds
    wait_until_compiled(eng)
    assert load.build is not None and runner.compiling is None  # built, then taken
    assert [run(eng, [p])[0] for p in prompts()] == expected
    assert runner.compiled is not None and runner.compiled.steps > 40
    stats = eng.stats()
    assert stats.compiled_decode == "on" and stats.compiled_decode_steps == runner.compiled.steps
    # The next engine loads the package in the background: no build.
    again = model_runner(engine(model_dir, compile="auto", device="cpu"))
    assert again.compiling is not None
    wait_until_sync(again.compiling.future.done, BUILD_TIMEOUT_S, "the package's load")
    assert again.compiling.build is None


async def test_an_idle_engine_reports_its_package_loaded(
    tiny_models: dict[str, Path], packages: Path
) -> None:
    """Nothing runs a step: the end of the background load alone renews the stats reported."""
    config = EngineConfig(
        model=str(tiny_models["llama-tied"]),
        dtype="float32",
        device="cpu",
        block_size=8,
        num_kv_blocks=128,
        compile="auto",
    )
    eng = await AsyncEngine.create(config)
    try:
        assert eng.stats().compiled_decode == "loading"
        await wait_until(
            lambda: eng.stats().compiled_decode == "on", BUILD_TIMEOUT_S, "the package's load"
        )
    finally:
        await eng.shutdown()


def wait_until_compiled(eng: LLMEngine) -> None:
    """Wait for the engine's package to be loaded in the background, then take it with a step."""
    load = model_runner(eng).compiling
    assert load is not None
    wait_until_sync(load.future.done, BUILD_TIMEOUT_S, "the package's build and load")
    assert model_runner(eng).compiled is None  # until a step takes it
    run(eng, prompts()[:1], new_tokens=1)
    assert isinstance(model_runner(eng).compiled, CompiledDecode)


def test_closing_stops_a_build_and_leaves_no_package(
    tiny_models: dict[str, Path], packages: Path
) -> None:
    runner = model_runner(engine(tiny_models["llama-tied"], compile="auto", device="cpu"))
    load = runner.compiling
    assert load is not None
    wait_until_sync(lambda: load.build is not None, 60, "the build's start")
    assert load.build is not None and not load.build.finished()
    runner.close()
    assert load.build.finished()
    with pytest.raises(BuildFailed, match="failed"):
        load.future.result(timeout=BUILD_TIMEOUT_S)
    assert [p.name for p in packages.iterdir() if not p.name.endswith(".lock")] == []


def test_workers_compile_in_the_background_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBATON_COMPILE")  # the suite's own setting (tests/conftest.py)
    assert worker_compile("agg", None) == worker_compile("decode", None) == "auto"
    assert worker_compile("prefill", None) == worker_compile("prefill", "auto") == "none"
    assert worker_compile("prefill", "single-decode") == "single-decode"  # asked for
    monkeypatch.setenv("KVBATON_COMPILE", "single-decode")
    assert worker_compile("agg", None) == "single-decode"
    assert worker_compile("agg", "none") == "none"  # the flag wins


def test_compile_is_refused_off_the_cpu() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(compile="single-decode", device="cuda")
    EngineConfig(compile="auto", device="cuda")  # auto: eager off the CPU
    with pytest.raises(ValueError, match="compile must be one of"):
        EngineConfig(compile="everything")


def test_a_build_is_refused_without_a_cpp_compiler(
    tiny_models: dict[str, Path], packages: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", ("kvbaton-no-such-compiler",))
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
        engine(tiny_models["llama-tied"], compile="single-decode", device="cpu")
    # auto looks for the compiler on a thread, where Inductor's config reads its defaults
    missing = "building a compiled decode needs a C++ compiler (stand-in)"
    monkeypatch.setattr(decode_package, "cxx_compiler_missing", lambda: missing)
    eng = engine(tiny_models["llama-tied"], compile="auto", device="cpu")
    load = model_runner(eng).compiling
    assert load is not None
    with pytest.raises(BuildFailed, match="needs a C\\+\\+ compiler"):
        load.future.result(timeout=BUILD_TIMEOUT_S)
    assert load.build is None
    run(eng, prompts()[:1], new_tokens=1)  # takes the failure: eager for good
    assert model_runner(eng).compiled is None and model_runner(eng).compiling is None
