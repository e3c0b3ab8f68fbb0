"""Overload: requests offered at 10x what one mocker worker serves, with load shedding and, as
the same run's baseline, without it.

    python bench/overload.py [--seconds 10] [--overload 10] [--model smollm2]

Each mode starts its own `kvbaton serve --engine mocker`, whose worker prefills one prompt a
step at 1 ms a prompt token (`--mocker-prefill 0,1,0 --max-num-batched-tokens 200`): about 5
requests/s of 200-token prompts with 8 output tokens. Requests go out open-loop (at their
times, whatever came back) at `--overload` times that rate for `--seconds`, each a distinct
prompt (no prefix-cache hits), to `/v1/completions`.

- shedding: `--busy-prefill-tokens 1000` (five prompts waiting at the worker): the excess is
  refused (503) at once;
- baseline: shedding off (`--busy-prefill-tokens 0`): every request queues at the worker, so the
  run lasts until the queue drains (`--seconds` x `--overload` seconds, about).

Figures per mode: requests served and refused, the refusals' latency p50/p99, and the served
requests' latency p50/p99/max (from sending to the whole answer). The headline is the served
p99 with shedding beside the baseline's; no issue sets a target for it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from headline import report
from serving import log, pct, run_benchmark, scratch_dir, start_serve, stop, wait_for_workers

PROMPT_TOKENS = 200
CAPACITY_RPS = 5.0  # 1 ms a prompt token, one prompt a step
OUTPUT_TOKENS = 8
BUSY_PREFILL_TOKENS = 5 * PROMPT_TOKENS
MODES = {"shedding": BUSY_PREFILL_TOKENS, "baseline (no shedding)": 0}


@dataclass
class Outcome:
    served: list[float]  # seconds from sending to the answer, of each request served
    refused: list[float]  # and to the 503, of each request refused

    def row(self, mode: str) -> str:
        refused = [
            f"{1000 * pct(self.refused, q):,.1f}" if self.refused else "-" for q in (0.5, 0.99)
        ]
        served = [f"{pct(self.served, q):,.2f}" for q in (0.5, 0.99, 1.0)]
        cells = [mode, str(len(self.served)), str(len(self.refused)), *refused, *served]
        return "| " + " | ".join(cells) + " |"


async def offer(url: str, model: str, seconds: float, rate: float) -> Outcome:
    """Requests at `rate` a second for `seconds`, open-loop; every answer awaited."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=500)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:

        async def one(i: int) -> tuple[int, float]:
            draw = random.Random(i)  # ids every vocabulary has; no two prompts share a block
            prompt = [draw.randrange(20, 150) for _ in range(PROMPT_TOKENS)]
            body = {"model": model, "prompt": prompt, "max_tokens": OUTPUT_TOKENS}
            started = time.perf_counter()
            r = await http.post("/v1/completions", json=body | {"ignore_eos": True})
            return r.status_code, time.perf_counter() - started

        await one(-1)  # warm
        tasks = []
        start = time.perf_counter()
        for i in range(int(seconds * rate)):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i)))
        results = await asyncio.gather(*tasks)
    unexpected = {status for status, _ in results} - {200, 503}
    if unexpected:
        raise RuntimeError(f"answers other than 200 and 503: {unexpected}")
    return Outcome(
        [t for status, t in results if status == 200],
        [t for status, t in results if status == 503],
    )


async def run(args: argparse.Namespace) -> int:
    outcomes: dict[str, Outcome] = {}
    rate = CAPACITY_RPS * args.overload
    for mode, busy in MODES.items():
        log(f"{mode}: starting kvbaton serve --engine mocker")
        served = start_serve(
            str(scratch_dir("kvb-overload-")),
            *("--engine", "mocker", "--model", args.model, "--log-level", "WARNING"),
            *("--mocker-prefill", "0,1,0", "--max-num-batched-tokens", str(PROMPT_TOKENS)),
            *("--busy-prefill-tokens", str(busy), "--busy-kv-usage", "0.9" if busy else "0"),
        )
        try:
            model = await wait_for_workers(served.url, 0, 1, 120.0)
            log(f"{mode}: {rate:g} requests/s for {args.seconds:g} s")
            outcomes[mode] = await offer(served.url, model, args.seconds, rate)
        finally:
            stop(served.proc)  # type: ignore[arg-type]
    print(
        f"overload: {args.overload:g}x one mocker worker's ~{CAPACITY_RPS:g} requests/s "
        f"({PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens) for {args.seconds:g} s"
    )
    print()
    print(
        "| mode | served | refused | refused p50 ms | refused p99 ms | "
        "served p50 s | served p99 s | served max s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, outcome in outcomes.items():
        print(outcome.row(mode))
    print()
    ours, theirs = (pct(o.served, 0.99) for o in outcomes.values())
    report(
        "overload",
        f"served p99 {ours:.2f} s with shedding at {args.overload:g}x",
        f"without shedding {theirs:.2f} s",
        ratio=ours / theirs,
    )
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="a pulled model or a directory")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--overload", type=float, default=10.0)
    run_benchmark(run, parser.parse_args())


if __name__ == "__main__":
    main()
