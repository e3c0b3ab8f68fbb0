"""The real default model, SmolLM2-135M-Instruct, after `kvbaton pull` (slow: the first run
downloads and converts it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbaton.engine import LLM, SamplingParams
from kvbaton.llm.model_files import pull

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return pull("smollm2", progress=lambda line: None)


def test_pull_prints_the_directory_last(smollm2: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvbaton", "pull"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    assert out.strip().splitlines()[-1] == str(smollm2)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (smollm2 / name).is_file()


def test_greedy_matches_hf_on_smollm2_in_float32(smollm2: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(smollm2), dtype="float32", kv_cache_gib=0.25)
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colors."}])
    prompts = [
        llm.tokenizer.encode("The capital of France is"),
        llm.tokenizer.encode("def fibonacci(n):\n    "),
        chat,
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, min_tokens=24, temperature=0))
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                pad_token_id=2,
            )
        assert out.token_ids == ref[0, len(prompt) :].tolist()


def test_smollm2_answers_a_chat_message_coherently(smollm2: Path) -> None:
    llm = LLM(model=str(smollm2), kv_cache_gib=0.25)  # bfloat16, the default
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=40, temperature=0),
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
