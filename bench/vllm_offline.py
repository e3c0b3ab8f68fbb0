"""vLLM's offline engine on `bench/engine.py`'s decode workload: run by engine.py with the Python
of a vLLM environment (`.venv-vllm`, scripts/vllm_env.sh), never imported.

    .venv-vllm/bin/python bench/vllm_offline.py < SPEC_JSON

- SPEC_JSON, on standard input (long prompts outgrow an argument): {"model": DIR,
  "kv_cache_bytes": N, "max_model_len": N, "new_tokens": N,
  "batches": {"B": [[prompt token ids, ...] per trial, ...]}}.
- Per batch size and trial: `LLM.generate` of the trial's prompts (greedy, exactly
  `new_tokens` each), timed from the call to its return (the prefill included, as engine.py
  times its own engine); after one untimed warm-up.
- vLLM's own defaults otherwise (eager mode off, its CPU thread binding), with an explicit KV
  cache size (on a CPU its default reserves most of a NUMA node's memory).
- Prints one line, `VLLM {"B": [tok/s per trial, ...], ...}`; progress goes to stderr.
"""

from __future__ import annotations

import json
import sys
import time

from vllm import LLM, SamplingParams  # type: ignore[import-not-found]
from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]


def main() -> None:
    spec = json.loads(sys.stdin.read())
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=spec["max_model_len"],
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
    )
    params = SamplingParams(
        temperature=0, max_tokens=spec["new_tokens"], min_tokens=spec["new_tokens"], ignore_eos=True
    )
    first = next(iter(spec["batches"].values()))[0][:1]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in first], params, use_tqdm=False)
    rates: dict[str, list[float]] = {}
    for batch, trials in spec["batches"].items():
        for t, prompts in enumerate(trials):
            t0 = time.perf_counter()
            llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
            )
            rate = len(prompts) * spec["new_tokens"] / (time.perf_counter() - t0)
            rates.setdefault(batch, []).append(rate)
            print(
                f"  vLLM decode b={batch}: trial {t + 1}/{len(trials)}: {rate:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    print("VLLM " + json.dumps(rates), flush=True)


if __name__ == "__main__":
    main()
