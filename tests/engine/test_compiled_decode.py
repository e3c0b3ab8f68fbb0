"""The compiled single-decode step (`--compile single-decode`): greedy tokens equal HF
transformers' in float32 for every architecture, whether a step runs compiled (one decode alone)
or eagerly (a batch, a prefill, a context of one block), and one compile serves every length."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbaton.engine import EngineConfig
from kvbaton.engine.compiled_decode import CompiledDecode
from tests.engine.reference import engine, hf_greedy, prompts, run

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # a compile per model: seconds each


@pytest.mark.parametrize("arch", ["llama-tied", "llama3-rope-untied", "qwen2-bias"])
def test_compiled_steps_give_hfs_tokens(tiny_models: dict[str, Path], arch: str) -> None:
    model_dir = tiny_models[arch]
    expected = [hf_greedy(model_dir, tuple(p)) for p in prompts()]
    eng = engine(model_dir, compile="single-decode", device="cpu")
    compiled = eng.runner.compiled
    assert isinstance(compiled, CompiledDecode) and compiled.steps == 1  # the warm-up
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert [run(eng, [p])[0] for p in prompts()] == expected
    assert compiled.steps > 40  # most decode steps of one sequence ran compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles  # no new compile
    steps = compiled.steps
    assert run(eng, prompts()) == expected  # batches run eagerly
    assert compiled.steps - steps < 12  # only the last sequence's last steps, if any


def test_compile_is_refused_off_the_cpu() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(compile="single-decode", device="cuda")
    with pytest.raises(ValueError, match="compile must be one of"):
        EngineConfig(compile="everything")


def test_compile_is_refused_without_a_cpp_compiler(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", ("kvbaton-no-such-compiler",))
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
        engine(tiny_models["llama-tied"], compile="single-decode", device="cpu")
