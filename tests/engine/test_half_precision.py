"""On CUDA, bfloat16 and float16 generate, and greedy tokens mostly agree with HF transformers
run on the same device in the same dtype. Half precision rounds differently in different
kernels, so agreement is measured and printed, not required to be exact. Skipped on the CPU
(run with KVBATON_TEST_DEVICE=cuda)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.conftest import TEST_DEVICE
from tests.engine.reference import engine, hf_greedy, prompts, run

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(
        not TEST_DEVICE.startswith("cuda"), reason="half precision is checked on CUDA"
    ),
]
NEW_TOKENS = 24
MIN_AGREEMENT = 0.5  # a floor far below what is expected: this catches broken, not rounding


def agreement(got: list[list[int]], expected: list[list[int]]) -> tuple[float, float]:
    """(share of sequences identical, share of tokens before each sequence's first difference)."""
    same = sum(g == e for g, e in zip(got, expected, strict=True))
    prefix = 0
    for g, e in zip(got, expected, strict=True):
        n = 0
        while n < len(e) and n < len(g) and g[n] == e[n]:
            n += 1
        prefix += n
    return same / len(expected), prefix / sum(map(len, expected))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["llama-tied", "llama3-rope-untied", "qwen2-bias"])
def test_half_precision_generates_and_mostly_agrees_with_hf(
    tiny_models: dict[str, Path], arch: str, dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tiny_models[arch]
    torch_dtype = getattr(torch, dtype)
    batch = prompts()
    expected = [hf_greedy(model_dir, tuple(p), NEW_TOKENS, torch_dtype) for p in batch]
    eng = engine(model_dir, dtype=dtype, max_num_batched_tokens=16)  # chunked prefill
    assert eng.runner.model.embed.dtype == torch_dtype  # type: ignore[attr-defined]
    assert eng.runner.model.embed.device.type == "cuda"  # type: ignore[attr-defined]
    alone = [run(eng, [p], NEW_TOKENS)[0] for p in batch]
    together = run(eng, batch, NEW_TOKENS)
    for out in alone + together:
        assert len(out) == NEW_TOKENS and all(0 <= t < eng.vocab_size for t in out)
    seq_alone, tok_alone = agreement(alone, expected)
    seq_together, tok_together = agreement(together, expected)
    seq_self, tok_self = agreement(together, alone)
    with capsys.disabled():
        print(
            f"\nHALF {dtype} {arch}: vs HF one at a time: {seq_alone:.0%} of sequences "
            f"identical, {tok_alone:.0%} of tokens before the first difference; all at once: "
            f"{seq_together:.0%} / {tok_together:.0%}; all at once vs one at a time: "
            f"{seq_self:.0%} / {tok_self:.0%}"
        )
    assert tok_alone >= MIN_AGREEMENT and tok_together >= MIN_AGREEMENT
