"""Decode-first under a burst: several prefill workers, one decode worker (or more).

    python bench/decode_first_burst.py [--prefill-workers 3] [--decode-workers 1]
                                       [--requests 24] [--prompt 2000,4000] [--repeats 3]

In decode-first order a request first takes blocks on its decode worker (its room), and only
once the room is announced does the router send the prompt to a prefill worker, which writes
the KV into the room. How many rooms a decode worker can have waiting at once therefore bounds
how many prompts all the prefill workers together compute for it. Prefill-first has no such
step: every prompt goes to a prefill worker at once. So prefill-first, measured in the same
run on the same deployment and the same burst, is the baseline: decode-first should give the
same time to first token, whatever the number of prefill workers.

For each repeat and each transfer order, a fresh deployment (`kvbaton serve --engine mocker
--mode disagg --prefill-workers P --decode-workers D --transfer-order ORDER`, load shedding
off: the burst is meant to queue) gets a few warm-up requests, then `--requests` streaming
`/v1/completions` requests sent at once, each a prompt of random token ids (no two share a
block: no prefix-cache hits) of `--prompt` tokens and 8 output tokens. Figures: time to first
token (TTFT) p50, p90 and max over the burst, and the time until the last request ended; each
the median over the repeats; then decode-first's over prefill-first's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time

import httpx

from disagg import REQUEST_TIMEOUT_S, Result, first_id, ready_url, send, span, vocab
from headline import report
from kvbaton.llm.model_files import resolve_model
from serving import STARTUP_S, clean_env, log, pct, run_benchmark, stop, wait_for_workers

ORDERS = ("prefill-first", "decode-first")
FIGURES = ("TTFT p50", "TTFT p90", "TTFT max", "last end")
OUTPUT_TOKENS = 8


def start(args: argparse.Namespace, order: str) -> tuple[subprocess.Popen[str], str]:
    command = [
        *(sys.executable, "-m", "kvbaton", "serve", "--engine", "mocker", "--http-port", "0"),
        *("--model", args.model, "--mode", "disagg", "--transfer-order", order),
        *("--prefill-workers", str(args.prefill_workers)),
        *("--decode-workers", str(args.decode_workers)),
        *("--busy-prefill-tokens", "0", "--busy-kv-usage", "0", "--log-level", "WARNING"),
    ]
    proc = subprocess.Popen(
        command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    url = ready_url(proc)
    if url is None:
        raise RuntimeError(f"kvbaton serve ({order}) exited before it was ready")
    return proc, url


async def burst(url: str, model: str, prompts: list[list[int]]) -> dict[str, float]:
    """Send every prompt at once; the figures in ms."""
    results = [Result("burst", expected_tokens=OUTPUT_TOKENS) for _ in prompts]
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        def body(prompt: list[int]) -> dict[str, object]:
            return {
                **{"model": model, "prompt": prompt, "max_tokens": OUTPUT_TOKENS},
                **{"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
            }

        started = time.perf_counter()
        await asyncio.gather(
            *(send(client, url, body(p), r) for p, r in zip(prompts, results, strict=True))
        )
    if any(r.output_tokens != OUTPUT_TOKENS for r in results):
        raise RuntimeError("a request ended without its output tokens")
    ttft = [r.ttft * 1e3 for r in results]
    last = (max(r.end for r in results) - started) * 1e3
    return dict(zip(FIGURES, (pct(ttft, 0.5), pct(ttft, 0.9), max(ttft), last), strict=True))


async def one_run(
    args: argparse.Namespace, order: str, prompts: list[list[int]], warm: list[list[int]]
) -> dict[str, float]:
    proc, url = start(args, order)
    try:
        model = await wait_for_workers(url, args.prefill_workers, args.decode_workers, STARTUP_S)
        await burst(url, model, warm)
        return await burst(url, model, prompts)
    finally:
        stop(proc)


async def run(args: argparse.Namespace) -> int:
    vocab_size = vocab(resolve_model(args.model))
    low = first_id(vocab_size)
    figures: dict[str, list[dict[str, float]]] = {order: [] for order in ORDERS}
    for repeat in range(args.repeats):
        rng = random.Random(args.seed + repeat)
        prompts = [
            [rng.randrange(low, vocab_size) for _ in range(rng.randint(*args.prompt))]
            for _ in range(args.requests)
        ]
        warm = [[rng.randrange(low, vocab_size) for _ in range(64)] for _ in range(4)]
        for order in ORDERS:
            log(f"repeat {repeat + 1}/{args.repeats}: {order}, {args.requests} requests at once")
            figures[order].append(await one_run(args, order, prompts, warm))
            log("  " + ", ".join(f"{k} {v:.0f} ms" for k, v in figures[order][-1].items()))
    medians = {
        order: {k: statistics.median(run[k] for run in runs) for k in FIGURES}
        for order, runs in figures.items()
    }
    print(
        f"{args.requests} requests at once, prompts of {args.prompt[0]}-{args.prompt[1]} tokens, "
        f"{OUTPUT_TOKENS} output tokens; {args.decode_workers} decode + {args.prefill_workers} "
        f"prefill workers (mocker); medians of {args.repeats} repeats, ms\n"
    )
    print("| order | " + " | ".join(FIGURES) + " |")
    print("|---|" + "---:|" * len(FIGURES))
    for order in ORDERS:
        print(f"| {order} | " + " | ".join(f"{medians[order][k]:.0f}" for k in FIGURES) + " |")
    ratios = [medians["decode-first"][k] / medians["prefill-first"][k] for k in FIGURES]
    print("| decode-first / prefill-first | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    print()
    shape = f"{args.requests} at once, {args.prefill_workers}P+{args.decode_workers}D"
    for figure in ("TTFT p90", "last end"):
        decode_first = medians["decode-first"][figure]
        prefill_first = medians["prefill-first"][figure]
        report(
            "decode_first_burst",
            f"decode-first {figure} {decode_first:,.0f} ms ({shape})",
            f"prefill-first {prefill_first:,.0f} ms",
            ratio=decode_first / prefill_first,
        )
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="whose tokenizer and vocabulary")
    parser.add_argument("--prefill-workers", type=int, default=3)
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt", type=span, default=(2000, 4000), metavar="MIN,MAX")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    run_benchmark(run, parser.parse_args())


if __name__ == "__main__":
    main()
