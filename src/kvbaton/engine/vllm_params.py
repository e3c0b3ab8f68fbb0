"""kvbaton's sampling options as vLLM's, and vLLM's outputs as kvbaton's (`vllm_engine.py`).
vLLM is imported when a function runs, never at import.

- Every kvbaton field but a thinking budget maps: max/min tokens, temperature,
  top_p/top_k/min_p, seed, the three penalties, ignore_eos, stop token ids, logprobs (of the
  output and of the prompt), logit bias, and a constraint (`Guided`) to vLLM's structured
  outputs (json schema, regex, choice, grammar). A JSON schema goes closed
  (`llm/json_schema.py`), as kvbaton's engine and a resumed constraint read it.
- Outputs stream as deltas (`RequestOutputKind.DELTA`), token ids only: vLLM does not
  detokenize (the frontend does, and matches stop strings there).
- A constraint replayed over a migrated request's tokens (`Guided.replay`) has no vLLM
  counterpart (vLLM's grammar starts at the first generated token): it goes in
  `extra_args[REPLAYED_CONSTRAINT]`, which kvbaton's logits processor applies
  (`vllm_constraint.py`).
- KV connector parameters (disaggregation) go in `extra_args["kv_transfer_params"]`, where
  vLLM's connectors read them.
- A thinking budget does not map (it places tokens): a required one is refused, another goes
  unenforced.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvbaton.llm.json_schema import closed
from kvbaton.protocols.llm import SamplingParams, TokenLogprob

# kvbaton's constraint kind -> vLLM's StructuredOutputsParams field.
GUIDED_FIELDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# The `extra_args` key of a replayed constraint (a `Guided` as a dict).
REPLAYED_CONSTRAINT = "kvbaton_replayed_constraint"
# The logits processor that applies it, as vLLM loads one (its module imports vLLM).
RESUMED_CONSTRAINTS = "kvbaton.engine.vllm_constraint:ResumedConstraints"


def vllm_sampling_params(params: SamplingParams, kv_transfer: dict[str, Any] | None = None) -> Any:
    """vLLM's SamplingParams for a validated `params`, with `kv_transfer` as vLLM's KV
    connector's parameters; ValueError (vLLM's own validation included) for options vLLM
    does not take."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    budget = params.thinking_budget
    if budget is not None and budget.required:
        raise ValueError(
            "thinking budgets are enforced by kvbaton's own engine (--engine torch), "
            "not on vLLM workers"
        )
    structured = None
    extra: dict[str, Any] = {}
    if kv_transfer:
        extra["kv_transfer_params"] = dict(kv_transfer)
    guided = params.guided
    if guided is not None and guided.replay:
        extra[REPLAYED_CONSTRAINT] = msgspec.structs.asdict(guided)
    elif guided is not None:
        spec: Any = guided.spec
        if guided.kind == "choice":
            spec = json.loads(spec)
        elif guided.kind == "json":
            spec = json.dumps(closed(json.loads(spec)))  # as kvbaton's grammar reads it
        structured = StructuredOutputsParams(**{GUIDED_FIELDS[guided.kind]: spec})
    return VllmSamplingParams(
        n=1,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=max(params.top_k, 0),  # kvbaton's -1 and 0 are off, vLLM's 0
        min_p=params.min_p,
        seed=params.seed,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        ignore_eos=params.ignore_eos,
        stop_token_ids=list(params.stop_token_ids),
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        logit_bias=dict(params.logit_bias) or None,
        structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
        extra_args=extra or None,
    )


def token_logprobs(
    token_ids: list[int], logprobs: Any, top: int
) -> list[list[TokenLogprob]] | None:
    """kvbaton's logprobs for a delta's tokens: per token, the chosen one's, then the `top`
    best by rank (which may hold the chosen one again, as kvbaton's engine gives them).
    `logprobs`: vLLM's per-token dicts (token id -> Logprob), or None."""
    if logprobs is None:
        return None
    entries: list[list[TokenLogprob]] = []
    for token, ranked in zip(token_ids, logprobs, strict=True):
        mine = ranked[token]
        chosen = TokenLogprob(token, float(mine.logprob), mine.rank or 0)
        best = sorted(
            ((lp.rank, tid, lp.logprob) for tid, lp in ranked.items() if lp.rank <= top),
        )
        entries.append([chosen, *(TokenLogprob(tid, float(lp)) for _, tid, lp in best)])
    return entries
