"""Small helpers for tests: bounded waits, stream collection, running a benchmark, the skip of
tests that need vLLM, a worker's load report."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvbaton.protocols.llm import WorkerLoad

T = TypeVar("T")
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
NEEDS_VLLM = pytest.mark.skipif(
    not VLLM_INSTALLED,
    reason="vLLM is not installed here: build .venv-vllm with scripts/vllm_env.sh",
)


def clean_env() -> dict[str, str]:
    """The environment of a process a test starts: none of the caller's `KVBATON_*` settings,
    and engines that run eagerly (`KVBATON_COMPILE=none`: a compiled decode's package takes
    minutes to build; the tests of compiled decoding ask for one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBATON_")}
    env["KVBATON_COMPILE"] = "none"
    return env


async def wait_until(
    predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition"
) -> float:
    """Poll `predicate` until it is true; returns the seconds waited, fails after `timeout`."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what} not met within {timeout}s")
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


def wait_until_sync(
    predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition"
) -> float:
    """`wait_until` for a thread with no event loop."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(0.005)
    return time.monotonic() - t0


async def collect(stream: AsyncIterable[T], limit: int | None = None) -> list[T]:
    """The stream's items; with `limit`, only the first `limit` (the rest are not read)."""
    items: list[T] = []
    async for item in stream:
        items.append(item)
        if limit is not None and len(items) >= limit:
            break
    return items


BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def fresh_interpreter(script: str, *args: str, timeout: float = 300) -> Any:
    """Run `script` in a fresh Python (what it imports is its own); the JSON of its last line
    of output."""
    out = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    ).stdout
    return json.loads(out.splitlines()[-1])


def run_bench(script: str, *args: str) -> tuple[str, list[list[str]]]:
    """Run `bench/<script>`; its output, and the cells of its Markdown table rows (no header)."""
    out = subprocess.run(
        [sys.executable, str(BENCH_DIR / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    return out, table_rows(out)


def table_rows(output: str) -> list[list[str]]:
    """The cells of the Markdown table rows in `output` (no header)."""
    rows = [line.split("|")[1:-1] for line in output.splitlines() if line.startswith("| ")][1:]
    return [[cell.strip() for cell in row] for row in rows]


def bench_headlines(output: str) -> list[Any]:
    """The headlines (`bench/headline.py`'s `Headline`) that a benchmark's stdout holds."""
    spec = importlib.util.spec_from_file_location("headline", BENCH_DIR / "headline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return list(module.parse(output))


def routed_series(registry: CollectorRegistry) -> set[str]:
    """The workers with a series of `kvbaton_router_requests_total` in `registry`."""
    return {
        sample.labels["worker"]
        for metric in registry.collect()
        if metric.name == "kvbaton_router_requests"
        for sample in metric.samples
        if sample.name == "kvbaton_router_requests_total"
    }


def scraped(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` with `labels` at `url` (a /metrics); 0 if none."""
    text = httpx.get(url).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


# Schemas that a tiny random model meets in a few tokens when they are enforced.
CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ADD_PARAMETERS: dict[str, Any] = {  # a tool's: a short call
    "type": "object",
    "properties": {"a": {"enum": [2, 3]}, "b": {"enum": [2, 3]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def idle_load(**fields: Any) -> WorkerLoad:
    """The load report of an idle worker of 8 KV blocks, but for `fields`."""
    idle: dict[str, Any] = {
        "instance_id": 1,
        "waiting": 0,
        "running": 0,
        "kv_blocks_total": 8,
        "kv_blocks_used": 0,
        "kv_blocks_free": 8,
        "prefix_cache_hit_rate": 0.0,
    }
    return WorkerLoad(**(idle | fields))
