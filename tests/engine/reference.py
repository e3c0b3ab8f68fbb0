"""The engine tests' reference: HF transformers' greedy tokens for a tiny model (float32 unless
asked), and the engine run on the same prompts, one at a time or all at once."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import torch

from kvbaton.engine import EngineConfig, LLMEngine, SamplingParams
from kvbaton.engine.connector import EngineRequest
from tests.engine.conftest import TEST_DEVICE

NEW_TOKENS = 12
PROMPT_LENGTHS = [1, 3, 16, 17, 40, 75]


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 96) for _ in range(n)] for n in PROMPT_LENGTHS]


@cache
def hf_greedy(
    model_dir: Path,
    prompt: tuple[int, ...],
    new_tokens: int = NEW_TOKENS,
    dtype: torch.dtype = torch.float32,
) -> list[int]:
    model = _hf_model(model_dir, dtype)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=TEST_DEVICE),
            max_new_tokens=new_tokens,
            do_sample=False,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@cache
def _hf_model(model_dir: Path, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(TEST_DEVICE).eval()


def engine(model_dir: Path, **kw: object) -> LLMEngine:
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", TEST_DEVICE)
    kw.setdefault("block_size", 8)
    kw.setdefault("num_kv_blocks", 128)
    return LLMEngine(EngineConfig(model=str(model_dir), **kw))  # type: ignore[arg-type]


def run(eng: LLMEngine, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0)
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(batch):
        eng.add_request(EngineRequest(f"r{i}-{id(batch)}", p, params))
        outs[f"r{i}-{id(batch)}"] = []
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.token_ids
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks  # every block came back
    return list(outs.values())
