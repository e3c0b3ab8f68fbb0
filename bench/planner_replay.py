"""Planner replay: the traces of bench/planner.py over many seeds, as arrivals per interval, fed
through the planner's own decisions (predictor and `ReplicaPlanner`), with no processes.

    python bench/planner_replay.py [--seeds 8] [--variants "level-shift:2,level-shift:1"]

For choosing settings on many traces in seconds, before a full `bench/planner.py` run on one.
Each variant is `PREDICTOR:PATIENCE`; the other settings are bench/planner.py's flags, with its
defaults. Per seed and variant it replays the 5-second counts of that seed's trace:
- worker-seconds: the workers decided at the end of each interval, held for the next one
  (starting at 1P+1D); no start-up or drain times, so they are below a real run's;
- prefill shortfall: arrivals beyond what the prefill workers of the interval serve at the TTFT
  target (their capacity in the planner's own model), summed: the requests that queue;
- starts and stops: worker processes started and stopped (flapping shows as both).
Printed: a table per seed, and the sums over seeds beside the first variant's (the baseline).
"""

from __future__ import annotations

import argparse
import collections
import math
from dataclasses import dataclass

from kvbaton.llm.model_files import resolve_model
from kvbaton.planner.perf_model import prefill_capacity
from kvbaton.planner.predictors import make_predictor
from kvbaton.planner.replicas import ReplicaPlanner
from kvbaton.planner.types import Observation
from planner import (
    add_shared_flags,
    check_shared_flags,
    model_profile,
    policy,
    predictor_spec,
    targets_for,
    trace,
    vocab_size,
)


@dataclass
class Replay:
    worker_seconds: float = 0.0
    shortfall: float = 0.0  # requests
    starts: int = 0
    stops: int = 0

    def add(self, other: Replay) -> None:
        self.worker_seconds += other.worker_seconds
        self.shortfall += other.shortfall
        self.starts += other.starts
        self.stops += other.stops


def counts(args: argparse.Namespace, vocab: int, seed: int) -> list[float]:
    """Arrivals per second in each interval of the seed's trace."""
    per = collections.Counter(
        int(r.at // args.interval)
        for r in trace(argparse.Namespace(**{**vars(args), "seed": seed}), vocab)
    )
    return [per[i] / args.interval for i in range(math.ceil(args.duration / args.interval))]


def replay(args: argparse.Namespace, rates: list[float], predictor: str, patience: int) -> Replay:
    variant = argparse.Namespace(**{**vars(args), "predictor": predictor, "patience": patience})
    profile = model_profile(args)
    targets = targets_for(args, profile)
    planner = ReplicaPlanner(profile, targets, policy(variant))
    per_prefill = prefill_capacity(profile, targets, args.isl) / args.isl  # requests/s
    predict = make_predictor(**predictor_spec(variant))
    prefill, decode = 1, 1
    out = Replay()
    for rate in rates:
        out.worker_seconds += (prefill + decode) * args.interval
        out.shortfall += max(0.0, rate - prefill * per_prefill) * args.interval
        predict.observe(rate)
        d = planner.decide(
            predict.predict(),
            args.isl,
            args.osl,
            0.0,
            Observation(interval_s=args.interval),
            prefill,
            decode,
        )
        out.starts += max(0, d.prefill - prefill) + max(0, d.decode - decode)
        out.stops += max(0, prefill - d.prefill) + max(0, decode - d.decode)
        prefill, decode = d.prefill, d.decode
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=8, help="seeds 0 .. N-1")
    parser.add_argument(
        "--variants",
        default="level-shift:2,level-shift:1,constant:2,constant:1",
        help="PREDICTOR:PATIENCE, comma-separated; the first is the baseline",
    )
    add_shared_flags(parser)
    args = parser.parse_args()
    check_shared_flags(parser, args)
    variants = []
    for spec in args.variants.split(","):
        name, _, patience = spec.partition(":")
        if not patience.isdigit() or int(patience) < 1:
            parser.error(f"variant {spec!r}: expected PREDICTOR:PATIENCE, patience >= 1")
        variants.append((name, int(patience)))

    vocab = vocab_size(resolve_model(args.model))
    labels = [f"{name}, patience {patience}" for name, patience in variants]
    totals = {label: Replay() for label in labels}
    print(
        f"planner replay: {args.seeds} seeds of bench/planner.py's trace ({args.duration:g}s, "
        f"peak x{args.peak_factor:g} for {args.peak_share:.0%}), interval {args.interval:g}s, "
        f"max step {args.max_step}; no start-up or drain times"
    )
    print()
    print("| seed | variant | worker-seconds | prefill shortfall (requests) | starts | stops |")
    print("|---|---|---:|---:|---:|---:|")
    for seed in range(args.seeds):
        rates = counts(args, vocab, seed)
        for label, (name, patience) in zip(labels, variants, strict=True):
            r = replay(args, rates, name, patience)
            totals[label].add(r)
            print(
                f"| {seed} | {label} | {r.worker_seconds:.0f} | {r.shortfall:.1f} | {r.starts} "
                f"| {r.stops} |"
            )
    print()
    base = totals[labels[0]]
    print(f"Over the {args.seeds} seeds, against {labels[0]}:")
    for label, r in totals.items():
        print(
            f"- {label}: {r.worker_seconds:.0f} worker-seconds "
            f"({r.worker_seconds / base.worker_seconds:.1%}), shortfall {r.shortfall:.1f} "
            f"requests ({r.shortfall - base.shortfall:+.1f}), {r.starts} starts, {r.stops} stops"
        )


if __name__ == "__main__":
    main()
