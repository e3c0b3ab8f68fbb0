"""Start-up benchmark: how long a user waits for a first answer from a cold `kvbaton serve`,
beside a fresh Python that loads the same model with HF transformers and generates one token,
and beside `vllm serve` where vLLM's venv exists (all in the same run).

    kvbaton pull && python bench/startup.py [--trials 3]

- Each figure: from launching the process to the end of its first one-token completion (HF:
  to the end of its `generate`); the median of `--trials` launches, taken in turns.
- kvbaton: `kvbaton serve --model M` (its own engine) and `--engine mocker` (no weights: the
  serving stack's own start, which a planner's scale-up waits for), each with a discovery
  directory of its own; ended by SIGINT after each launch.
- vLLM (where `--vllm-python`, by default `.venv-vllm/bin/python`, exists): `vllm serve M`
  with only what it needs to start here (a KV cache size, eager mode, the model length).
- Warm starts: the first launch reads the model into the OS's file cache for the rest.
- No target: no issue sets one. The ratios are kvbaton's time over the baseline's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from headline import report
from kvbaton.llm.model_files import resolve_model
from serving import (
    STARTUP_S,
    clean_env,
    free_port,
    log,
    run_benchmark,
    start_serve,
    stop,
    vllm_env,
)

BENCH = Path(__file__).resolve().parent
VLLM_KV_CACHE_BYTES = 1 << 30
HF_FIRST_TOKEN = """
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
model.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=1, do_sample=False)
"""


def first_answer(url: str, deadline: float) -> None:
    """A one-token completion of the first model the server lists, asked until it answers one
    (until `deadline`)."""
    while True:
        try:
            if models := httpx.get(f"{url}/v1/models", timeout=30.0).json()["data"]:
                body = {"model": models[0]["id"], "prompt": "Hello", "max_tokens": 1}
                answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30.0)
                if answer.status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer from {url} within {STARTUP_S:.0f}s of its launch")
        time.sleep(0.1)


def kvbaton_serve(model_dir: Path, *flags: str) -> Callable[[], float]:
    def launch() -> float:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="kvbaton-bench-") as discovery:
            serve = start_serve(f"file://{discovery}", "--model", str(model_dir), *flags)
            try:
                first_answer(serve.url, started + STARTUP_S)
                return time.monotonic() - started
            finally:
                stop(serve.proc)  # type: ignore[arg-type]

    return launch


def vllm_serve(python: Path, model_dir: Path) -> Callable[[], float]:
    def launch() -> float:
        started, port = time.monotonic(), free_port()
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", model_dir.name,
            "--enforce-eager", "--kv-cache-memory-bytes", str(VLLM_KV_CACHE_BYTES),
            "--max-model-len", "8192",
        ]  # fmt: skip
        with tempfile.NamedTemporaryFile(prefix="vllm-serve-", suffix=".log", delete=False) as out:
            proc = subprocess.Popen(
                command, env=vllm_env(), stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )
        try:
            first_answer(f"http://127.0.0.1:{port}", started + STARTUP_S)
            seconds = time.monotonic() - started
        except RuntimeError as e:
            raise RuntimeError(f"{e}; its output: {out.name}") from None
        finally:
            stop(proc)  # type: ignore[arg-type]
        Path(out.name).unlink()  # kept only where it did not answer
        return seconds

    return launch


def hf_first_token(model_dir: Path) -> Callable[[], float]:
    def launch() -> float:
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-c", HF_FIRST_TOKEN, str(model_dir)],
            check=True,
            timeout=STARTUP_S,
            env=clean_env(),
        )
        return time.monotonic() - started

    return launch


def measure(args: argparse.Namespace) -> dict[str, float]:
    """The median seconds to a first answer of each system, launched in turns."""
    model_dir = resolve_model(args.model)
    systems = {
        "kvbaton serve": kvbaton_serve(model_dir),
        "kvbaton serve --engine mocker": kvbaton_serve(model_dir, "--engine", "mocker"),
        "HF transformers": hf_first_token(model_dir),
    }
    if args.vllm_python.exists():
        systems["vllm serve"] = vllm_serve(args.vllm_python, model_dir)
    else:
        log(f"no vLLM baseline: no {args.vllm_python}")
    times: dict[str, list[float]] = {name: [] for name in systems}
    for trial in range(1, args.trials + 1):
        for name, launch in systems.items():
            times[name].append(launch())
            log(f"trial {trial}/{args.trials}: {name} answered in {times[name][-1]:.2f}s")
    return {name: statistics.median(seconds) for name, seconds in times.items()}


async def run(args: argparse.Namespace) -> int:
    seconds = measure(args)
    serve, hf = seconds["kvbaton serve"], seconds["HF transformers"]
    print(f"\n{args.model}, seconds from launch to a first answer (median of {args.trials}):\n")
    print("| system | seconds | kvbaton serve / it |")
    print("|---|---|---|")
    for name, value in seconds.items():
        print(f"| {name} | {value:.2f} | {serve / value:.2f}x |")
    report(
        "startup",
        f"serve's first answer {serve:.2f} s",
        f"HF transformers load + 1 token {hf:.2f} s",
        ratio=serve / hf,
    )
    if "vllm serve" in seconds:
        theirs = seconds["vllm serve"]
        report(
            "startup",
            f"serve's first answer {serve:.2f} s",
            f"vllm serve's first answer {theirs:.2f} s",
            ratio=serve / theirs,
        )
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=BENCH.parent / ".venv-vllm" / "bin" / "python",
        help="vLLM's venv (scripts/vllm_env.sh); no vLLM baseline where it does not exist",
    )
    run_benchmark(run, parser.parse_args())


if __name__ == "__main__":
    main()
