"""Engine benchmark: SmolLM2-135M-Instruct in bfloat16 on this CPU, kvbaton's engine beside HF
transformers (same weights, same dtype, same run) and the memory-bandwidth bound of batch 1.

    kvbaton pull && python bench/engine.py [--trials 3] [--batches 1 8 32 64]

- prefill: tokens/s over 512-token prompts, one at a time;
- decode: output tokens/s for B prompts (32 tokens each) x 128 new tokens, wall time from
  submission to the last token (so it includes the prefill), for each batch size B;
- bound: measured read bandwidth / bytes of weights read per batch-1 decode step.
Each figure is the median of the trials; the ratio column is kvbaton / HF.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvbaton.engine import EngineConfig, LLMEngine, SamplingParams
from kvbaton.llm.model_files import resolve_model

PROMPT_LEN = 32
NEW_TOKENS = 128
PREFILL_LEN = 512


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def read_bandwidth_gbs(trials: int) -> float:
    """Median GB/s of summing a 512 MiB float32 tensor (a pure read of memory)."""
    data = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    data.sum()
    runs = []
    for _ in range(max(3, trials)):
        t0 = time.perf_counter()
        data.sum()
        runs.append(data.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return statistics.median(runs)


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(200, 40000, (batch, length), generator=gen).tolist()  # type: ignore[no-any-return]


def ours_decode(engine: LLMEngine, batch: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
    for i, p in enumerate(batch):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", p, params)
    t0 = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
    assert produced == len(batch) * NEW_TOKENS
    return produced / (time.perf_counter() - t0)


def ours_prefill(engine: LLMEngine, batch: list[list[int]]) -> float:
    engine.clear_kv_blocks()  # no prefix hits from earlier trials
    params = SamplingParams(max_tokens=1, temperature=0)
    t0 = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"p{time.monotonic_ns()}-{i}", p, params)
        while engine.has_unfinished():
            engine.step()
    return sum(map(len, batch)) / (time.perf_counter() - t0)


def hf_decode(model: Any, batch: list[list[int]]) -> float:
    ids = torch.tensor(batch)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
    assert out.shape[1] == PROMPT_LEN + NEW_TOKENS
    return len(batch) * NEW_TOKENS / (time.perf_counter() - t0)


def hf_prefill(model: Any, batch: list[list[int]]) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in batch:
            model(torch.tensor([p]), use_cache=True)
    return sum(map(len, batch)) / (time.perf_counter() - t0)


def median_of(trials: int, label: str, run: Callable[[int], float]) -> float:
    runs = []
    for t in range(trials):
        runs.append(run(t))
        say(f"  {label}: trial {t + 1}/{trials}: {runs[-1]:.1f} tok/s")
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prefill-prompts", type=int, default=4)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    model_dir = resolve_model(args.model)
    say(
        f"engine benchmark: {model_dir.name}, bfloat16, {torch.get_num_threads()} threads, "
        f"{args.trials} trials; loading both models"
    )
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), dtype="bfloat16", kv_cache_gib=1.0, max_num_batched_tokens=2048
        )
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    bandwidth = read_bandwidth_gbs(args.trials)
    model = engine.runner.model
    narrow_bytes = sum(
        p.weight.numel() * p.weight.element_size()
        for layer in model.layers
        for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
    )
    narrow_bytes += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    bound = bandwidth * 1e9 / narrow_bytes

    rows = []
    say("prefill")
    prefill = prompts(args.prefill_prompts, PREFILL_LEN, seed=1)
    ours = median_of(
        args.trials,
        "kvbaton prefill",
        lambda t: ours_prefill(engine, prompts(args.prefill_prompts, PREFILL_LEN, seed=100 + t)),
    )
    theirs = median_of(args.trials, "HF prefill", lambda t: hf_prefill(hf, prefill))
    rows.append(("prefill, 512-token prompts", ours, theirs))
    for b in args.batches:
        say(f"decode batch {b}")
        ours = median_of(
            args.trials,
            f"kvbaton decode b={b}",
            lambda t, b=b: ours_decode(engine, prompts(b, PROMPT_LEN, seed=t)),
        )
        theirs = median_of(
            args.trials,
            f"HF decode b={b}",
            lambda t, b=b: hf_decode(hf, prompts(b, PROMPT_LEN, seed=t)),
        )
        rows.append((f"decode, {b} x {NEW_TOKENS} tokens", ours, theirs))

    print("| workload | kvbaton tok/s | HF transformers tok/s | kvbaton / HF |")
    print("|---|---:|---:|---:|")
    for name, ours, theirs in rows:
        print(f"| {name} | {ours:,.1f} | {theirs:,.1f} | {ours / theirs:.2f} |")
    print()
    print(
        f"memory read bandwidth {bandwidth:.1f} GB/s; batch-1 decode reads "
        f"{narrow_bytes / 1e6:.0f} MB of weights per step -> bound {bound:.1f} tok/s; "
        f"kvbaton batch 1 reaches {rows[1][1] / bound:.0%} of it"
        if 1 in args.batches
        else f"memory read bandwidth {bandwidth:.1f} GB/s"
    )


if __name__ == "__main__":
    main()
