"""What the `--engine vllm` tests share (they run where vLLM is installed: the environment
scripts/vllm_env.sh builds): the marks, SmolLM2's engine settings, and vLLM's own offline
answers to compare with (greedy, and seeded with penalties)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.frontend.conftest import _READY, Deployment, _start
from tests.helpers import NEEDS_VLLM

MODEL_DIR = Path.home() / ".cache" / "kvbaton" / "models" / "smollm2"  # `kvbaton pull`
VLLM_MARKS = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.timeout(900),  # a module's deployment starts in its first test's time
    NEEDS_VLLM,
    pytest.mark.skipif(not MODEL_DIR.is_dir(), reason="SmolLM2 is not pulled (`kvbaton pull`)"),
]
MAX_MODEL_LEN = 1024
KV_CACHE_GIB = 0.25  # per worker: about 11,000 tokens of SmolLM2
ENGINE_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-gib", str(KV_CACHE_GIB)]
READY_S = 600.0  # two vLLM engines starting on a loaded 2-core machine
MAX_TOKENS = 24
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    # Over two of vLLM's 128-token blocks on a CPU: KV that moves in whole blocks too.
    "Count on: " + ", ".join(str(i) for i in range(1, 120)) + ",",
]

OFFLINE = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if __name__ == "__main__":  # vLLM spawns its engine process: it imports this module
        model, max_model_len, kv_bytes, max_tokens, prompts, samplings = json.loads(sys.argv[1])
        llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=max_model_len,
                  kv_cache_memory_bytes=kv_bytes)
        texts = {}
        for name, sampling in samplings.items():
            params = SamplingParams(max_tokens=max_tokens, **sampling)
            texts[name] = []
            for ids in prompts:  # one at a time, as the tests send them to serve
                prompt = TokensPrompt(prompt_token_ids=ids)
                (out,) = llm.generate([prompt], params, use_tqdm=False)
                texts[name].append(out.outputs[0].text)
        print("OFFLINE " + json.dumps(texts), flush=True)
    """
)


# The sampling options of the offline answers, by name: each as the OpenAI API takes it.
SAMPLINGS: dict[str, dict[str, float]] = {
    "greedy": {"temperature": 0},
    # What no engine can go on from another's token (a seeded generator, output counts).
    "seeded": {"temperature": 0.9, "seed": 11, "frequency_penalty": 0.6, "presence_penalty": 0.4},
}


def prompt_ids() -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in TEXTS]


def offline_texts(sampling: str = "greedy") -> list[str]:
    """vLLM's own answers to `prompt_ids()` with `SAMPLINGS[sampling]` (`LLM.generate`, the
    same settings); computed while no deployment runs, so that the two do not share the
    cores."""
    return _offline()[sampling]


@functools.cache
def _offline() -> dict[str, list[str]]:
    """Every sampling's answers, from one offline engine, once per session (its ipc sockets,
    which vLLM leaves, go with its directory)."""
    with tempfile.TemporaryDirectory(prefix="vllm-offline-") as directory:
        script = Path(directory) / "offline.py"
        script.write_text(OFFLINE)
        kv_bytes = int(KV_CACHE_GIB * (1 << 30))
        spec = [str(MODEL_DIR), MAX_MODEL_LEN, kv_bytes, MAX_TOKENS, prompt_ids(), SAMPLINGS]
        done = subprocess.run(
            [sys.executable, str(script), json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=READY_S,
            cwd=directory,
            env=os.environ | {"VLLM_RPC_BASE_PATH": directory},
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("OFFLINE ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    texts: dict[str, list[str]] = json.loads(lines[-1].removeprefix("OFFLINE "))
    assert all(all(answers) for answers in texts.values()), texts  # something to compare
    return texts


def serve_vllm(discovery: Path, *flags: str, ipc_base: Path | None = None) -> Deployment:
    """`kvbaton serve --engine vllm` on SmolLM2 with `flags`, once it is ready; `ipc_base`:
    where vLLM's ipc sockets go (`VLLM_RPC_BASE_PATH`; None: vLLM's default)."""
    command = ["serve", "--engine", "vllm", "--model", str(MODEL_DIR), *ENGINE_FLAGS, *flags]
    env = {} if ipc_base is None else {"VLLM_RPC_BASE_PATH": str(ipc_base)}
    return _start(command, _READY, discovery, MODEL_DIR.name, ready_s=READY_S, env=env)
