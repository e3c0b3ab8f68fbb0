"""Engine benchmark: SmolLM2-135M-Instruct in bfloat16 on this CPU, kvbaton's engine beside HF
transformers (same weights, same dtype, same run) and the memory-bandwidth bound of batch 1.

    kvbaton pull && python bench/engine.py [--trials 3] [--batches 1 8 32 64] [--prompt-tokens 32]
    python bench/engine.py --random-weights --device cuda   # on a GPU, nothing pulled

--device and --dtype choose where and in what both engines run (default: the CPU, bfloat16).
--random-weights builds a model of SmolLM2-135M's exact shape with random weights in a
temporary directory instead of using the pulled one: the same speed, meaningless tokens.

- prefill: tokens/s over 512-token prompts, one at a time;
- decode: output tokens/s for B prompts (32 tokens each, or --prompt-tokens: long contexts) x
  128 new tokens, wall time from submission to the last token (so it includes the prefill), for
  each batch size B; every KV cache holds the largest batch whole;
- bound: measured read bandwidth / bytes of weights read per batch-1 decode step, the bandwidth
  read again right before each batch-1 trial (on a shared host it drifts by half over minutes);
  a batch-1 figure's share of the bound is the median of each trial's rate over the bound then;
- the engines: the first one runs eagerly (`--compile none`, and what the default serves while
  its package builds); then, on the CPU unless --no-compiled, batch 1 again on an engine of
  compiled single decodes, as `kvbaton serve` runs by default once the package of its model is
  built (`--compile auto`; built once per machine into `kvbaton`'s cache: minutes, said when
  this run built it), beside the same bound;
- vLLM (where `--vllm-python`, by default `.venv-vllm/bin/python`, exists): vLLM's offline
  `LLM.generate` on the same decode prompts, in a process of its own once the other two are
  done (`bench/vllm_offline.py`: vLLM's defaults, an explicit KV cache size).
Each figure is the median of the trials; the ratio columns are kvbaton / HF and kvbaton / vLLM.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from headline import at_least, report
from kvbaton.engine import EngineConfig, LLMEngine, SamplingParams
from kvbaton.engine.connector import EngineRequest
from kvbaton.engine.decode_package import PackageSpec
from kvbaton.engine.model import LlamaModel, Projection
from kvbaton.llm.model_files import resolve_model
from kvbaton.mocker.tiers import MODELED_DTYPE_BYTES, modeled_block_bytes
from serving import vllm_env

PROMPT_LEN = 32
NEW_TOKENS = 128
PREFILL_LEN = 512
MIN_KV_CACHE_BYTES = 1 << 30
VLLM_TIMEOUT_S = 1800.0  # vLLM's start-up, a warm-up and every trial
BENCH = Path(__file__).resolve().parent
SMOLLM2_135M = {  # SmolLM2-135M's config.json, for --random-weights
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so wall time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {torch.get_num_threads()} threads"


def random_smollm2_135m(path: Path) -> Path:
    """A random-weight model of SmolLM2-135M's exact shape, saved (bfloat16) under `path`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_135M)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def step_projections(model: LlamaModel) -> list[Projection]:
    """Every projection a decode step reads, in the step's order: each layer's qkv, o, gate/up
    and down, then the LM head (their weights are what the bandwidth bound counts)."""
    layers = [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return [*layers, model.lm_head]


def read_bandwidth_gbs(trials: int, device: torch.device) -> float:
    """Median GB/s of summing a 512 MiB float32 tensor (a pure read of memory)."""
    data = torch.ones(128 * 1024 * 1024, dtype=torch.float32, device=device)
    data.sum()
    sync(device)
    runs = []
    for _ in range(max(3, trials)):
        t0 = time.perf_counter()
        data.sum()
        sync(device)
        runs.append(data.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return statistics.median(runs)


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(200, 40000, (batch, length), generator=gen).tolist()  # type: ignore[no-any-return]


def decode_trial(engine: LLMEngine, batch: int, prompt_tokens: int, trial: int) -> float:
    return ours_decode(engine, prompts(batch, prompt_tokens, seed=trial))


def ours_decode(engine: LLMEngine, batch: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
    for i, p in enumerate(batch):
        engine.add_request(EngineRequest(f"d{time.monotonic_ns()}-{i}", p, params))
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
        engine.add_request(EngineRequest(f"p{time.monotonic_ns()}-{i}", p, params))
        while engine.has_unfinished():
            engine.step()
    return sum(map(len, batch)) / (time.perf_counter() - t0)


def hf_decode(model: Any, batch: list[list[int]]) -> float:
    ids = torch.tensor(batch, device=model.device)
    sync(model.device)
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
    sync(model.device)
    assert out.shape[1] == len(batch[0]) + NEW_TOKENS
    return len(batch) * NEW_TOKENS / (time.perf_counter() - t0)


def hf_prefill(model: Any, batch: list[list[int]]) -> float:
    sync(model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in batch:
            model(torch.tensor([p], device=model.device), use_cache=True)
    sync(model.device)
    return sum(map(len, batch)) / (time.perf_counter() - t0)


def kv_cache_bytes(model_dir: Path, batch: int, prompt_tokens: int, dtype: str) -> int:
    """A KV cache in `dtype` that holds `batch` decodes whole (no preemption), at least 1 GiB."""
    token_bytes = modeled_block_bytes(model_dir, 1) // MODELED_DTYPE_BYTES
    per_token = token_bytes * torch.finfo(getattr(torch, dtype)).bits // 8
    return max(MIN_KV_CACHE_BYTES, int(1.2 * batch * (prompt_tokens + NEW_TOKENS) * per_token))


def vllm_decode(
    python: Path, model_dir: Path, batches: list[int], trials: int, prompt_tokens: int
) -> dict[int, float]:
    """vLLM's decode tok/s per batch size (median of the trials) on the prompts `ours_decode`
    gets; exits with vLLM's own error when it fails."""
    spec = {
        "model": str(model_dir),
        "kv_cache_bytes": kv_cache_bytes(model_dir, max(batches), prompt_tokens, "bfloat16"),
        "max_model_len": prompt_tokens + NEW_TOKENS,
        "new_tokens": NEW_TOKENS,
        "batches": {b: [prompts(b, prompt_tokens, seed=t) for t in range(trials)] for b in batches},
    }
    try:
        done = subprocess.run(
            [str(python), str(BENCH / "vllm_offline.py")],
            input=json.dumps(spec),
            stdout=subprocess.PIPE,
            text=True,
            timeout=VLLM_TIMEOUT_S,
            env=vllm_env(),
        )
    except subprocess.TimeoutExpired:
        sys.exit(f"vLLM's offline run did not end within {VLLM_TIMEOUT_S:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("VLLM ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"vLLM's offline run failed (exit {done.returncode}): its stderr is above")
    rates: dict[str, list[float]] = json.loads(lines[-1].removeprefix("VLLM "))
    return {int(b): statistics.median(r) for b, r in rates.items()}


class BoundedTrials:
    """Batch-1 trials, each beside the bandwidth bound read right before it, by kind ("" for
    the eager engine, "compiled")."""

    def __init__(self, device: torch.device, step_bytes: int) -> None:
        self.device = device
        self.step_bytes = step_bytes  # weights read per batch-1 step
        self.trials: dict[str, list[tuple[float, float]]] = {}  # kind -> (GB/s, tok/s)

    def median_of(self, kind: str, trials: int, label: str, run: Callable[[int], float]) -> float:
        """`median_of`, the bandwidth read before each trial."""
        runs = self.trials.setdefault(kind, [])
        for t in range(trials):
            bandwidth = read_bandwidth_gbs(3, self.device)
            runs.append((bandwidth, run(t)))
            bound = bandwidth * 1e9 / self.step_bytes
            say(
                f"  {label}: trial {t + 1}/{trials}: {runs[-1][1]:.1f} tok/s, "
                f"{runs[-1][1] / bound:.0%} of the bound then ({bandwidth:.1f} GB/s)"
            )
        return statistics.median(rate for _, rate in runs)

    def bandwidth(self, kind: str = "") -> float:
        return statistics.median(gbs for gbs, _ in self.trials[kind])

    def bound(self, kind: str = "") -> float:
        return self.bandwidth(kind) * 1e9 / self.step_bytes

    def share(self, kind: str) -> float:
        """The median over the trials of each one's tok/s over its bound."""
        return statistics.median(
            rate * self.step_bytes / (gbs * 1e9) for gbs, rate in self.trials[kind]
        )


def median_of(trials: int, label: str, run: Callable[[int], float], unit: str = "tok/s") -> float:
    runs = []
    for t in range(trials):
        runs.append(run(t))
        say(f"  {label}: trial {t + 1}/{trials}: {runs[-1]:.1f} {unit}")
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.add_argument(
        "--prompt-tokens", type=int, default=PROMPT_LEN, help="each decode prompt's length"
    )
    parser.add_argument("--device", default="cpu", help="a torch device: cpu (default), cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="a random model of SmolLM2-135M's shape instead of --model",
    )
    parser.add_argument(
        "--no-compiled",
        action="store_true",
        help="skip batch 1 on the compiled engine (`--compile single-decode`, CPU only)",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=BENCH.parent / ".venv-vllm" / "bin" / "python",
        help="a vLLM environment's Python, for vLLM's offline engine as a second baseline "
        "(skipped where it does not exist, or on another device than the CPU)",
    )
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    if args.random_weights:
        scratch = tempfile.TemporaryDirectory(prefix="smollm2-135m-random-")  # gone at exit
        model_dir = random_smollm2_135m(Path(scratch.name))
        name = "SmolLM2-135M shape, random weights"
    else:
        model_dir = resolve_model(args.model)
        name = model_dir.name
    header = (
        f"engine benchmark: {name}, {args.dtype}, {device_name(device)}, "
        f"torch {torch.__version__}, {args.trials} trials, "
        f"{args.prompt_tokens}-token decode prompts"
    )
    say(f"{header}; loading both models")
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype=args.dtype,
            device=args.device,
            kv_cache_gib=kv_cache_bytes(
                model_dir, max(args.batches), args.prompt_tokens, args.dtype
            )
            / 2**30,
            max_num_batched_tokens=2048,
        )
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    hf = hf.to(device).eval()

    model = engine.runner.model
    narrow_bytes = sum(p.nbytes for p in step_projections(model))
    bounded = BoundedTrials(device, narrow_bytes)

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
        label = f"kvbaton decode b={b}"
        run = functools.partial(decode_trial, engine, b, args.prompt_tokens)
        if b == 1:
            ours = bounded.median_of("", args.trials, label, run)
        else:
            ours = median_of(args.trials, label, run)
        theirs = median_of(
            args.trials,
            f"HF decode b={b}",
            lambda t, b=b: hf_decode(hf, prompts(b, args.prompt_tokens, seed=t)),
        )
        rows.append((f"decode, {b} x {NEW_TOKENS} tokens", ours, theirs))
    compiled = None
    if 1 in args.batches and args.device == "cpu" and not args.no_compiled:
        say("decode batch 1 compiled: an engine with --compile single-decode (built if needed)")
        del engine  # its cache and weights: one engine at a time
        config = EngineConfig(
            model=str(model_dir), dtype=args.dtype, device="cpu", compile="single-decode"
        )
        built = PackageSpec.of_engine(model_dir, config).path.is_file()
        start = time.monotonic()
        engine = LLMEngine(config)
        how = "its package loaded" if built else "its package built first"
        say(f"the compiled engine started in {time.monotonic() - start:.0f} s ({how})")
        compiled = bounded.median_of(
            "compiled",
            args.trials,
            "kvbaton compiled decode b=1",
            functools.partial(decode_trial, engine, 1, args.prompt_tokens),
        )
    vllm: dict[int, float] = {}
    if args.vllm_python.exists() and args.device == "cpu" and args.dtype == "bfloat16":
        say(f"decode with vLLM's offline engine ({args.vllm_python})")
        vllm = vllm_decode(
            args.vllm_python, model_dir, args.batches, args.trials, args.prompt_tokens
        )
    else:
        say(f"no vLLM baseline: no {args.vllm_python}, or not the CPU in bfloat16")

    print(header)
    print()
    print("| workload | kvbaton tok/s | HF transformers tok/s | kvbaton / HF |")
    print("|---|---:|---:|---:|")
    for name, ours, theirs in rows:
        print(f"| {name} | {ours:,.1f} | {theirs:,.1f} | {ours / theirs:.2f} |")
    decode = dict(zip(args.batches, rows[1:], strict=True))  # batch size -> its decode row
    print()
    if 1 in decode:
        print(
            f"batch-1 decode reads {narrow_bytes / 1e6:.0f} MB of weights per step; memory read "
            f"bandwidth before its trials {bounded.bandwidth():.1f} GB/s (median) -> bound "
            f"{bounded.bound():.1f} tok/s; kvbaton batch 1 reaches {bounded.share(''):.0%} of "
            "the bound of its trials (median)"
        )
    if compiled is not None:
        print(
            f"batch 1 compiled (the default once its package is built): {compiled:,.1f} tok/s, "
            f"{bounded.share('compiled'):.0%} of the bound of its trials "
            f"({compiled / decode[1][1]:.2f}x the eager engine)"
        )
    if vllm:
        print()
        print("| decode | kvbaton tok/s | vLLM offline tok/s | kvbaton / vLLM |")
        print("|---|---:|---:|---:|")
        for b, rate in vllm.items():
            print(
                f"| {b} x {NEW_TOKENS} tokens | {decode[b][1]:,.1f} | {rate:,.1f} | "
                f"{decode[b][1] / rate:.2f} |"
            )
    print()
    report_headlines(decode, bounded, vllm, compiled)


def report_headlines(
    decode: dict[int, tuple[str, float, float]],
    bounded: BoundedTrials,
    vllm: dict[int, float],
    compiled: float | None,
) -> None:
    """Batch-1 decode, eager and compiled (the default, where it ran), against the bandwidth bound
    (issue 32's target: at least 0.60 of it); at batch 1 (eager) and the largest batch, against
    vLLM's offline engine where it ran (issue 32's target: at least 1.0x), else against HF
    transformers (no target)."""
    batch_1 = {"": decode[1][1]} if 1 in decode else {}
    if compiled is not None:
        batch_1["compiled"] = compiled
    names = {"": "eager", "compiled": "the default (compiled)"}
    for kind, ours in batch_1.items():
        share = bounded.share(kind)
        target, met = at_least(share, 0.60)
        report(
            "engine",
            f"batch-1 decode, {names[kind]} {ours:,.1f} tok/s",
            f"bandwidth bound {bounded.bound(kind):,.1f} tok/s",
            ratio=share,
            target=target,
            met=met,
        )
    for b in sorted({min(decode), max(decode)}):
        _, ours, theirs = decode[b]
        suffix = ", eager" if b == 1 else ""  # batch 1 of the default engine is compiled
        if b in vllm:
            target, met = at_least(ours / vllm[b], 1.0)
            report(
                "engine",
                f"batch-{b} decode{suffix} {ours:,.1f} tok/s",
                f"vLLM offline {vllm[b]:,.1f} tok/s",
                ratio=ours / vllm[b],
                target=target,
                met=met,
            )
        else:
            report(
                "engine",
                f"batch-{b} decode{suffix} {ours:,.1f} tok/s",
                f"HF transformers {theirs:,.1f} tok/s",
                ratio=ours / theirs,
            )


if __name__ == "__main__":
    main()
