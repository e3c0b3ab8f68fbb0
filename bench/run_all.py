"""Every headline figure in one run: the benchmarks under bench/ one after another, then one
Markdown table of their headlines (docs/benchmarks.md's headline table).

    python bench/run_all.py --quick            # short runs of everything in the repo: minutes
    python bench/run_all.py                    # each benchmark's full run: hours
    python bench/run_all.py --only engine,routing --out /tmp/bench-out
    python bench/run_all.py --side-by-side     # Dynamo and vLLM beside kvbaton: their venvs

- The in-repo set needs nothing outside the repo (the SmolLM2 model is pulled by the
  benchmarks that use it). The side-by-side set needs `.venv-dynamo` (`scripts/dynamo_env.sh`)
  and `.venv-vllm` (`scripts/vllm_env.sh`); a missing venv is a row that says so.
- Each benchmark is one process; its progress (stderr) passes through, its stdout is kept
  (with `--out DIR`, as DIR/<name>.txt) and its headlines (`bench/headline.py`) go into the
  table. One that fails, times out or prints no headline is a row that says so; the run goes on.
- Quick runs are short: fewer requests, trials and repeats than the full ones, so their
  figures are noisier. The table says which mode it is.
- Printed last: the machine, the commit (marked when bench/ or src/ has uncommitted changes),
  the date and the table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from headline import Headline, parse
from serving import log

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
QUICK_TIMEOUT_S = 900.0
FULL_TIMEOUT_S = 6 * 3600.0
STOP_GRACE_S = 60.0


@dataclass(frozen=True)
class Benchmark:
    name: str  # the script's name without .py
    quick: tuple[str, ...]  # the arguments of a quick run
    full: tuple[str, ...] = ()  # the arguments of a full run (its defaults where empty)
    python: str = ""  # a venv's Python, relative to the repo; this Python where empty
    side_by_side: bool = False  # needs a peer's venv: run only with --side-by-side

    def argv(self, quick: bool) -> list[str]:
        python = str(ROOT / self.python) if self.python else sys.executable
        args = self.quick if quick else self.full
        return [python, str(BENCH / f"{self.name}.py"), *args]

    def missing(self) -> str:
        """Why it cannot run here, or ""."""
        if self.python and not (ROOT / self.python).exists():
            return f"no {self.python}"
        if self.name == "vs_dynamo" and not (ROOT / ".venv-dynamo/bin/python").exists():
            return "no .venv-dynamo/bin/python"
        return ""


BENCHMARKS = (
    Benchmark("request_plane", ("--duration", "1", "--trials", "3")),
    Benchmark("frontend", ("--requests", "1000", "--duration", "2", "--trials", "3")),
    Benchmark("engine", ("--trials", "1", "--batches", "1", "64")),
    Benchmark("step_breakdown", ("--trials", "1")),
    Benchmark("startup", ("--trials", "1")),
    Benchmark("structured", ("--trials", "1")),
    Benchmark("serve_vs_offline", ("--repeats", "1", "--requests", "2")),
    Benchmark(
        "routing",
        ("--repeats", "1", "--modes", "round-robin,kv,kv-2-frontends", "--sessions", "16"),
    ),
    Benchmark("kv_transfer", ("--trials", "3")),
    Benchmark("kv_push", ("--trials", "1", "--prompts", "2", "--lengths", "512")),
    Benchmark("decode_first_burst", ()),
    Benchmark("disagg", ("--repeats", "1")),
    Benchmark("kv_tiers", ("--sessions", "4", "--turns", "2", "--doc-tokens", "1000", "2000")),
    Benchmark(
        "planner", ("--duration", "45", "--interval", "3", "--configs", "fixed-peak,planner")
    ),
    Benchmark("soak", ("--minutes", "1", "--window-s", "20", "--calibrate-s", "10")),
    Benchmark("overload", ("--seconds", "5")),
    Benchmark(
        "vs_dynamo",
        ("--concurrency", "1,64", "--requests", "1000", "--requests-at-1", "50"),
        side_by_side=True,
    ),
    Benchmark(
        "vllm_front",
        ("--repeats", "1", "--requests", "2"),
        python=".venv-vllm/bin/python",
        side_by_side=True,
    ),
    Benchmark(
        "vs_vllm",
        ("--repeats", "1", "--requests", "2"),
        python=".venv-vllm/bin/python",
        side_by_side=True,
    ),
)


@dataclass
class Outcome:
    benchmark: Benchmark
    headlines: list[Headline] = field(default_factory=list)
    failure: str = ""  # why it gave no figures: "exit 1", "timed out", "no .venv-vllm/..."
    seconds: float = 0.0


def run_one(bench: Benchmark, quick: bool, out_dir: Path | None) -> Outcome:
    """Run one benchmark to its end or its timeout; its headlines or why there are none."""
    outcome = Outcome(bench)
    if why := bench.missing():
        outcome.failure = why
        return outcome
    timeout = QUICK_TIMEOUT_S if quick else FULL_TIMEOUT_S
    started = time.monotonic()
    proc = subprocess.Popen(
        bench.argv(quick), cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout = stop(proc)
        outcome.failure = f"timed out after {timeout:.0f} s"
    outcome.seconds = time.monotonic() - started
    if out_dir is not None:
        (out_dir / f"{bench.name}.txt").write_text(stdout)
    outcome.headlines = parse(stdout)
    if not outcome.failure and proc.returncode != 0:
        outcome.failure = f"exit {proc.returncode}"
    if not outcome.failure and not outcome.headlines:
        outcome.failure = "no headline printed"
    return outcome


def stop(proc: subprocess.Popen[str]) -> str:
    """Interrupt a benchmark (it stops its own children), then kill its session if it lingers;
    what it printed."""
    proc.send_signal(signal.SIGINT)
    try:
        stdout, _ = proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
        stdout, _ = proc.communicate()
    return stdout


def verdict(met: bool | None) -> str:
    return "—" if met is None else ("met" if met else "**missed**")


def table(outcomes: list[Outcome], quick: bool) -> str:
    lines = [
        "| benchmark | command | figure | same-run baseline | ratio | target | verdict |",
        "|---|---|---|---|---:|---|---|",
    ]
    for outcome in outcomes:
        bench = outcome.benchmark
        name = f"`{bench.name}`"
        command = f"`{' '.join(['python', f'bench/{bench.name}.py', *bench.argv(quick)[2:]])}`"
        if outcome.failure:
            lines.append(f"| {name} | {command} | not measured: {outcome.failure} | | | | |")
            command = ""
        for h in outcome.headlines:
            ratio = "" if h.ratio is None else f"{h.ratio:.2f}x"
            lines.append(
                f"| {name} | {command} | {h.figure} | {h.baseline} | {ratio} | {h.target} "
                f"| {verdict(h.met)} |"
            )
            command = ""
    return "\n".join(lines)


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--", "src", "bench")
    return f"{head} + uncommitted changes" if dirty else head


def machine() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown CPU",
    )
    kib = int(Path("/proc/meminfo").read_text().split()[1])
    python = platform.python_version()
    return f"{model}, {os.cpu_count()} cores, {kib / 2**20:.0f} GiB, Python {python}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (minutes in all)")
    parser.add_argument(
        "--side-by-side", action="store_true", help="run the Dynamo and vLLM comparisons only"
    )
    parser.add_argument("--only", type=lambda s: s.split(","), help="these benchmarks, a,b,...")
    parser.add_argument("--out", type=Path, help="keep each benchmark's stdout in this folder")
    args = parser.parse_args()
    chosen = [b for b in BENCHMARKS if b.side_by_side == args.side_by_side]
    if args.only:
        unknown = set(args.only) - {b.name for b in BENCHMARKS}
        if unknown:
            parser.error(f"unknown benchmark(s) {sorted(unknown)}")
        chosen = [b for b in BENCHMARKS if b.name in args.only]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    at = commit()
    outcomes = []
    for i, bench in enumerate(chosen, 1):
        log(f"[{i}/{len(chosen)}] {bench.name}: {' '.join(bench.argv(args.quick)[1:])}")
        outcome = run_one(bench, args.quick, args.out)
        log(
            f"[{i}/{len(chosen)}] {bench.name}: {outcome.failure or 'done'} in "
            f"{outcome.seconds:.0f} s, {len(outcome.headlines)} headline(s)"
        )
        outcomes.append(outcome)
    mode = "quick (short runs, noisier figures)" if args.quick else "full"
    print(f"\nMachine: {machine()}")
    print(f"Commit: {at}; date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(f"Mode: {mode}; {sum(o.seconds for o in outcomes) / 60:.1f} minutes in all\n")
    print(table(outcomes, args.quick))
    sys.exit(1 if any(o.failure for o in outcomes) else 0)


if __name__ == "__main__":
    main()
