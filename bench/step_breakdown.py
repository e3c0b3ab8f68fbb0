"""Where a batch-1 decode step's time goes: SmolLM2-135M-Instruct (or --model), bfloat16,
kvbaton's engine on this CPU, beside the same run's memory-bandwidth bound.

    kvbaton pull && python bench/step_breakdown.py [--trials 3]

- step: the median decode step of one 32-token prompt x 128 new tokens (`LLMEngine.step`'s
  wall time, the prefill step left out);
- projections: the step's projections alone (each layer's qkv, o, gate/up and down, then the
  LM head), called on one row in a step's order on the engine's own packed kernels, and the rate
  at which they stream their weights from memory;
- the rest: the step less its projections (norms, RoPE, cache writes, attention, sampling,
  the scheduler and Python between the ops), and how many operator calls a step makes (counted
  by torch's profiler over one decode);
- baseline: `bench/engine.py`'s summing loop (read bandwidth) in the same run, the bound it gives
  batch 1, and the step time issue 32's target (60% of that bound) allows.
Each time is the median of the trials. The headline is the projections' streaming rate beside
the summing loop's: their ratio is the share of the bound a step of projections alone reaches,
the ceiling of batch 1 on these kernels (no target of its own: `bench/engine.py` judges issue
32's).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import NEW_TOKENS, PROMPT_LEN, median_of, read_bandwidth_gbs, say, step_projections
from headline import report
from kvbaton.engine import EngineConfig, LLMEngine, SamplingParams
from kvbaton.engine.connector import EngineRequest
from kvbaton.engine.model import LlamaModel, Projection
from kvbaton.engine.model_runner import projection_kernel
from kvbaton.llm.model_files import resolve_model

TARGET_SHARE = 0.6  # issue 32: batch-1 decode at least 60% of the bandwidth bound


def decode_steps_ms(engine: LLMEngine, prompt: list[int]) -> list[float]:
    """Wall time of each decode step of one request (its prefill step left out)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
    engine.add_request(EngineRequest(f"s{time.monotonic_ns()}", prompt, params))
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times[1:]


def random_prompt(vocab_size: int, seed: int) -> list[int]:
    """A random prompt of `PROMPT_LEN` token ids below `vocab_size`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (PROMPT_LEN,), generator=gen).tolist()  # type: ignore[no-any-return]


def projection_calls(model: LlamaModel) -> list[tuple[Projection, torch.Tensor]]:
    """Every projection of a step in its order (`step_projections`), each with a one-row input
    of its width."""
    c = model.config
    layer = [c.hidden, c.num_heads * c.head_dim, c.hidden, c.hf.intermediate_size]
    widths = layer * c.num_layers + [c.hidden]
    rows = {width: torch.randn(1, width).to(model.dtype) for width in set(widths)}
    return list(zip(step_projections(model), (rows[w] for w in widths), strict=True))


def projections_ms(calls: list[tuple[Projection, torch.Tensor]], repeats: int) -> float:
    """Median wall time of one pass over `calls`."""
    with torch.inference_mode():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for projection, x in calls:
                projection(x)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def operator_calls_per_step(engine: LLMEngine, prompt: list[int]) -> float:
    """Operator calls (every level) per decode step, over one profiled decode."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        steps = len(decode_steps_ms(engine, prompt)) + 1
    return sum(event.count for event in prof.key_averages()) / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="a pulled model's name or a directory")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()

    model_dir = resolve_model(args.model)
    say(f"step breakdown: loading {model_dir.name}")
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", device="cpu"))
    model = engine.runner.model
    vocab = model.config.vocab_size
    calls = projection_calls(model)
    weight_bytes = sum(projection.nbytes for projection, _ in calls)
    decode_steps_ms(engine, random_prompt(vocab, seed=99))  # warm-up

    bandwidth = read_bandwidth_gbs(args.trials, torch.device("cpu"))
    step = median_of(
        args.trials,
        "batch-1 decode step",
        lambda t: statistics.median(decode_steps_ms(engine, random_prompt(vocab, seed=t))),
        unit="ms",
    )
    projections = median_of(
        args.trials, "projections", lambda t: projections_ms(calls, NEW_TOKENS), unit="ms"
    )
    say("counting operator calls (one decode under torch's profiler)")
    operators = operator_calls_per_step(engine, random_prompt(vocab, seed=50))
    bound_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    budget_ms = bound_ms / TARGET_SHARE
    stream_gbs = weight_bytes / (projections / 1e3) / 1e9
    kernel = projection_kernel("auto", torch.bfloat16, torch.device("cpu"))

    print(
        f"step breakdown: {model_dir.name}, bfloat16, CPU, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, projections on {kernel}, {args.trials} trials"
    )
    print()
    print("| part of a batch-1 decode step | ms | share of the step |")
    print("|---|---:|---:|")
    print(f"| whole step | {step:.2f} | 100% |")
    print(
        f"| projections alone ({weight_bytes / 1e6:.0f} MB of weights at {stream_gbs:.1f} GB/s) "
        f"| {projections:.2f} | {projections / step:.0%} |"
    )
    print(
        f"| the rest ({operators:.0f} operator calls a step) | {step - projections:.2f} | "
        f"{(step - projections) / step:.0%} |"
    )
    print()
    print(
        f"summing loop {bandwidth:.1f} GB/s: the weights alone at that rate {bound_ms:.2f} ms a "
        f"step (the bound, {1e3 / bound_ms:.1f} tok/s); {TARGET_SHARE:.0%} of the bound allows "
        f"{budget_ms:.2f} ms a step; this step reaches {bound_ms / step:.0%} of the bound"
    )
    report(
        "step_breakdown",
        f"projections stream {stream_gbs:.1f} GB/s (their {projections:.2f} ms of a "
        f"{step:.2f} ms step)",
        f"summing loop {bandwidth:.1f} GB/s",
        ratio=stream_gbs / bandwidth,
    )


if __name__ == "__main__":
    main()
