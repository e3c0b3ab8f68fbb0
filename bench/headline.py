"""A benchmark's headline: its figure beside the same run's baseline, and the target it meets or
misses; `bench/run_all.py` collects them into docs/benchmarks.md's headline table.

- A benchmark prints each headline as one stdout line, `headline: {json}`, after its tables.
- The benchmark judges its own target: `met` is None only where it sets none.
- `ratio` is figure / baseline in the figure's own unit (None where they differ in kind).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

PREFIX = "headline: "


@dataclass(frozen=True)
class Headline:
    benchmark: str  # the script's name without .py
    figure: str  # what was measured and its value: "batch-1 decode 34.6 tok/s"
    baseline: str  # the same run's reference and its value: "bandwidth bound 98.1 tok/s"
    ratio: float | None
    target: str  # the target in words: "ratio at least 0.60"; "" where none
    met: bool | None

    def line(self) -> str:
        return PREFIX + json.dumps(asdict(self))


def report(
    benchmark: str,
    figure: str,
    baseline: str,
    *,
    ratio: float | None,
    target: str = "",
    met: bool | None = None,
) -> None:
    """Print one headline line on stdout."""
    headline = Headline(benchmark, figure, baseline, ratio, target, met)
    print(headline.line(), flush=True)


def at_least(ratio: float, floor: float) -> tuple[str, bool]:
    """The target text and verdict of 'ratio at least `floor`'."""
    return f"ratio at least {floor:g}", ratio >= floor


def at_most(ratio: float, ceiling: float) -> tuple[str, bool]:
    """The target text and verdict of 'ratio at most `ceiling`'."""
    return f"ratio at most {ceiling:g}", ratio <= ceiling


def parse(output: str) -> list[Headline]:
    """Every headline in a benchmark's stdout, in order."""
    return [
        Headline(**json.loads(line[len(PREFIX) :]))
        for line in output.splitlines()
        if line.startswith(PREFIX)
    ]
