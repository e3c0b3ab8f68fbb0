"""What a JSON-schema constraint costs the engine: decode time per step with and without one,
in the same run, on SmolLM2-135M-Instruct (bfloat16, this CPU), and a grammar's compile time.

    kvbaton pull && python bench/structured.py [--trials 3] [--batches 1 32]

- decode: B requests (32-token prompts), 128 new tokens each, greedy; ms per engine step once
  every request has its first token (each step decodes one token of each). Constrained: a
  schema whose answers run long (an array of 40 small objects), so no answer ends before 128
  tokens; unconstrained: `ignore_eos`, the same length.
- compile: a 20-property schema, cold (its first compile; the tokenizer read once before) and
  cached (the same schema again).
Each figure is the median of the trials; the ratio is constrained / unconstrained (issue 29's
targets: at most 1.10 at batch 1, 1.15 at batch 32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from headline import at_most, report
from kvbaton.engine import EngineConfig, LLMEngine, SamplingParams
from kvbaton.engine.connector import EngineRequest
from kvbaton.engine.guided import GuidedDecoding
from kvbaton.llm.model_files import resolve_model
from kvbaton.protocols.llm import Guided

PROMPT_LEN = 32
NEW_TOKENS = 128
LONG = {
    "type": "array",
    "minItems": 40,
    "maxItems": 40,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
}
WIDE = {
    "type": "object",
    "properties": {f"field_{i}": {"type": "string", "maxLength": 12} for i in range(20)},
    "required": [f"field_{i}" for i in range(20)],
}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def decode_ms_per_step(eng: LLMEngine, batch: int, guided: Guided | None, trial: int) -> float:
    """ms per step once every request of the batch has its first token."""
    if guided is None:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    else:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, guided=guided)
    started: set[str] = set()
    for i in range(batch):
        prompt = [(trial * 131 + i * 17 + k) % 40000 + 100 for k in range(PROMPT_LEN)]
        eng.add_request(EngineRequest(f"t{trial}-{i}-{guided is not None}", prompt, params))
    steps, since = 0, 0.0
    lengths: dict[str, int] = {}
    while eng.has_unfinished():
        outputs = eng.step()
        if len(started) == batch:
            steps += 1
        for out in outputs:
            started.add(out.request_id)
            lengths[out.request_id] = lengths.get(out.request_id, 0) + len(out.token_ids)
            if out.finish_reason not in (None, "length"):
                raise SystemExit(f"{out.request_id} ended early ({out.finish_reason})")
        if len(started) == batch and not since:
            since = time.perf_counter()
    assert set(lengths.values()) == {NEW_TOKENS}, lengths
    return (time.perf_counter() - since) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    model_dir = resolve_model("smollm2")
    say("loading smollm2 ...")
    eng = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", kv_cache_gib=1.0))
    guided = Guided(kind="json", spec=json.dumps(LONG))
    assert eng.guided is not None
    eng.guided.compile(guided)  # not timed here: see the compile figures
    say("warming up ...")
    decode_ms_per_step(eng, 2, guided, -1)
    decode_ms_per_step(eng, 2, None, -1)
    rows = []
    for batch in args.batches:
        times: dict[bool, list[float]] = {False: [], True: []}
        for trial in range(args.trials):
            for constrained in (trial % 2 == 0, trial % 2 != 0):  # alternate which goes first
                say(f"batch {batch}, trial {trial + 1}/{args.trials}, constrained={constrained}")
                ms = decode_ms_per_step(eng, batch, guided if constrained else None, trial)
                times[constrained].append(ms)
        plain, constrained_ms = statistics.median(times[False]), statistics.median(times[True])
        rows.append((batch, plain, constrained_ms))
    cold, cached = [], []
    for trial in range(args.trials):
        fresh = GuidedDecoding(model_dir, eng.runner.vocab_size, eng.eos_token_ids)
        fresh.compile(Guided(kind="regex", spec="x"))  # reads the tokenizer: not counted
        wide = Guided(kind="json", spec=json.dumps(WIDE | {"title": f"t{trial}"}))
        t0 = time.perf_counter()
        fresh.compile(wide)
        t1 = time.perf_counter()
        fresh.compile(wide)
        cold.append((t1 - t0) * 1e3)
        cached.append((time.perf_counter() - t1) * 1e3)
    print(
        f"structured outputs: smollm2 bfloat16, {PROMPT_LEN}-token prompts x {NEW_TOKENS} "
        f"new tokens, greedy, median of {args.trials} trials\n"
    )
    print("| batch | unconstrained ms/step | json_schema ms/step | ratio | target |")
    print("|---:|---:|---:|---:|---:|")
    for batch, plain, constrained_ms in rows:
        target = 1.10 if batch == 1 else 1.15
        ratio = constrained_ms / plain
        verdict = "met" if ratio <= target else "MISSED"
        figures = f"{plain:.1f} | {constrained_ms:.1f} | {ratio:.2f}"
        print(f"| {batch} | {figures} | {target:.2f} {verdict} |")
    print(
        f"\ngrammar compile, 20-property schema: cold {statistics.median(cold):.1f} ms, "
        f"cached {statistics.median(cached):.3f} ms"
    )
    print()
    for batch, plain, constrained_ms in rows:  # the table's figures, one headline a batch size
        ratio = constrained_ms / plain
        goal, met = at_most(ratio, 1.10 if batch == 1 else 1.15)
        report(
            "structured",
            f"batch {batch} json_schema {constrained_ms:.1f} ms/step",
            f"unconstrained {plain:.1f} ms/step",
            ratio=ratio,
            target=goal,
            met=met,
        )


if __name__ == "__main__":
    main()
