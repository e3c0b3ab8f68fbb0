"""LLM types that cross process boundaries: sampling options and engine outputs."""

from __future__ import annotations

from typing import Any

import msgspec


class Guided(msgspec.Struct, kw_only=True, frozen=True):
    """A constraint on the output, enforced by the engine as a token mask: `kind` "json" (a JSON
    schema), "regex", "choice" (a JSON list of strings) or "grammar" (llguidance's Lark).
    `replay`: the prompt's last tokens that were generated under it (a migrated request's)."""

    kind: str
    spec: str
    replay: int = 0

    KINDS = ("json", "regex", "choice", "grammar")


class ThinkingBudget(msgspec.Struct, kw_only=True, frozen=True):
    """At most `tokens` tokens of reasoning: the engine then places `end`, the closing tag's
    token id, itself (`engine/thinking_budget.py`).

    - `start`: the opening tag's id; the reasoning starts only if the output opens with it.
      None: the output starts inside the reasoning.
    - The reasoning ends before the budget where the output holds `end`.
    - `replay`: the prompt's last tokens that were generated (a migrated request's).
    - `required` False: an engine that cannot place tokens goes on without the budget (where
      clients send one whatever the model, as Anthropic's do); True: it refuses the request
      (vLLM's; the mocker, which draws nothing from a model, ignores budgets).
    - No constraint goes with it (a constraint applies from the output's first token).
    """

    tokens: int
    end: int
    start: int | None = None
    replay: int = 0
    required: bool = True


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick tokens and when to stop. `temperature == 0` is greedy.

    Validated by `validate()`; an engine may assume a validated object."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: int | None = None  # number of top logprobs per token (0: only the chosen one)
    # ... per prompt token after the first (0: only its own); such a request computes its
    # whole prompt (no prefix-cache hits) where it decodes.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)  # token id -> added
    guided: Guided | None = None
    thinking_budget: ThinkingBudget | None = None

    MAX_LOGIT_BIAS = 100.0

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first bad field; returns self."""
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (
                0 <= self.min_tokens <= self.max_tokens,
                "min_tokens",
                "must be between 0 and max_tokens",
            ),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 (off) or positive"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                "logprobs",
                "must be between 0 and 20",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                "must be between 0 and 20",
            ),
            (
                all(abs(b) <= self.MAX_LOGIT_BIAS for b in self.logit_bias.values()),
                "logit_bias",
                f"values must be in [-{self.MAX_LOGIT_BIAS:g}, {self.MAX_LOGIT_BIAS:g}]",
            ),
        ]
        if self.guided is not None:
            checks += [
                (self.guided.kind in Guided.KINDS, "guided", f"kind must be one of {Guided.KINDS}"),
                (self.guided.replay >= 0, "guided", "replay must be at least 0"),
                (not self.min_tokens, "min_tokens", "cannot go with a constraint"),
                (not self.ignore_eos, "ignore_eos", "cannot go with a constraint"),
            ]
        if (budget := self.thinking_budget) is not None:
            checks += [
                (budget.tokens >= 0, "thinking_budget", "tokens must be at least 0"),
                (budget.replay >= 0, "thinking_budget", "replay must be at least 0"),
                (self.guided is None, "thinking_budget", "cannot go with a constraint"),
            ]
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"{name} {message} (got {getattr(self, name)!r})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def state_beyond_tokens(self) -> str | None:
        """What the sampling keeps that the tokens produced so far do not carry (so another
        engine given them as prompt would not go on the same way), or None."""
        if self.seed is not None and not self.greedy:
            return "its seeded sampling cannot resume on another engine"
        if self.frequency_penalty or self.presence_penalty:
            return "its frequency/presence penalties count outputs another engine cannot see"
        return None


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    rank: int = 0  # its place in its distribution (1: the likeliest); 0: not known


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class KvPoolInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How a peer reaches a worker's KV pool: blocks of `block_bytes`, each contiguous across
    all layers, block i at offset i * block_bytes. Pools exchange blocks only when their
    `layout` (dtype and block shape) is equal."""

    layout: str
    num_blocks: int
    block_bytes: int
    host: str  # the machine: shared memory works between pools of the same host
    shm_name: str = ""  # the pool's shared-memory segment, if it lives in one
    tcp_address: str = ""  # "host:port" of the worker's KV transfer server
    nixl_metadata: bytes = b""  # the NIXL agent's metadata, if it has one


class DisaggregatedParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A prefill worker's answer (step S5): where the prompt's KV waits and how to fetch it.
    The blocks stay held until released through `release_endpoint` (or a timeout)."""

    prefill_instance_id: int
    prefill_component: str  # "namespace.component": its `kv_release` endpoint
    handle: str  # names the held blocks in release calls
    block_ids: list[int]  # the prompt's blocks at the prefill worker, in prompt order
    num_tokens: int  # the prompt tokens whose KV they hold
    block_size: int
    first_token_ids: list[int]  # sampled by the prefill worker
    pool: KvPoolInfo
    cached_tokens: int = 0  # prompt tokens the prefill worker found in its prefix cache
    engine_params: dict[str, Any] | None = None  # an engine's own (vLLM's kv_transfer_params)

    @property
    def by_engine(self) -> bool:
        """The engine moves the KV itself (`engine_params`), not kvbaton's pools."""
        return self.engine_params is not None


class KvTarget(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Decode-first: the blocks a decode worker allocated for a prompt, for a prefill worker to
    claim (`kv_claim`), write the prompt's KV into (blocks `first_block...` of the prompt; those
    before it the decode worker has cached), then report on (`kv_ready`)."""

    decode_instance_id: int
    decode_component: str  # "namespace.component": its `kv_claim` and `kv_ready` endpoints
    room: str  # names the waiting request there
    block_ids: list[int]
    first_block: int
    block_size: int
    pool: KvPoolInfo
    engine_params: dict[str, Any] | None = None  # an engine's own (vLLM's kv_transfer_params)


class EngineOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New tokens of one request since its previous output. The last one has `finish_reason`
    ("stop": EOS or a stop token; "length": max_tokens or the context; "abort"), or, from a
    prefill worker, `disaggregated_params` (an engine's held request: `kv_blocks`). A decode
    worker's first output in decode-first order is `kv_target`, with no tokens."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    # One entry per new token: the chosen token's logprob, then the top alternatives.
    logprobs: list[list[TokenLogprob]] | None = None
    # On a request's first output, with `prompt_logprobs`: an entry per prompt token after
    # the first (the first has nothing before it), as in `logprobs`, its token's rank known.
    prompt_logprobs: list[list[TokenLogprob]] | None = None
    kv_blocks: list[int] | None = None
    # With `kv_blocks` from an engine that moves KV itself: its own transfer parameters
    # (vLLM's kv_transfer_params; the blocks are its own, `kv_blocks` empty).
    engine_params: dict[str, Any] | None = None
    disaggregated_params: DisaggregatedParams | None = None
    kv_target: KvTarget | None = None

    @property
    def is_last(self) -> bool:
        return (
            self.finish_reason is not None
            or self.kv_blocks is not None
            or self.disaggregated_params is not None
        )

    @property
    def carries_tokens_only(self) -> bool:
        """New tokens (with their logprobs, finish reason and usage), nothing for KV moves."""
        return (
            self.kv_blocks is None
            and self.engine_params is None
            and self.disaggregated_params is None
            and self.kv_target is None
        )

    def merged(self, later: EngineOutput) -> EngineOutput | None:
        """This output and the `later` one of the same request as one; None where they must stay
        two (either moves KV, or this one is the last).

        - Tokens and logprobs keep their order; the finish reason and usage are `later`'s; the
          prompt's logprobs are the first output's (only a request's first has them).
        - A stream of merged outputs says what the stream of the parts said."""
        if self.is_last or not (self.carries_tokens_only and later.carries_tokens_only):
            return None
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return EngineOutput(
            request_id=later.request_id,
            token_ids=self.token_ids + later.token_ids,
            finish_reason=later.finish_reason,
            usage=later.usage,
            logprobs=logprobs,
            prompt_logprobs=(
                self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
            ),
        )


class PreprocessedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a frontend sends to a worker's `generate` endpoint (step S2): the prompt already
    templated and tokenized, and the sampling options validated. Stop strings stay with the
    frontend (they are matched on text); the worker stops on token ids only."""

    model: str
    token_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    cache_salt: str | None = None
    # From the PrefillRouter: the prompt's KV waits at a prefill worker (step S6).
    disaggregated_params: DisaggregatedParams | None = None
    # Decode-first: to a decode worker, "a prefill worker will write the prompt's KV" (it
    # answers with `kv_target` first); to a prefill worker, where to write it.
    bootstrap: bool = False
    kv_target: KvTarget | None = None


class ModelCard(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A served model, as a worker registers it at `/models/{namespace}/{name}/{instance_id:x}`
    (owned by the worker's lease). The frontend serves a model while at least one card of it
    lives, and sends its requests to `endpoint` on the instance that registered the card."""

    name: str
    endpoint: str  # "namespace.component.generate"
    instance_id: int
    context_length: int
    kv_block_size: int
    model_path: str = ""  # the worker's directory; a frontend on the same machine reads it
    tokenizer_files: list[str] = msgspec.field(default_factory=list)  # else fetched from it
    created: int = 0  # seconds since the epoch
    kv_events: bool = False  # the worker publishes KV events (endpoints kv_events, kv_dump)
    role: str = "agg"  # or "prefill" (a PrefillRouter's target) or "decode", as workers write
    kv_pool: KvPoolInfo | None = None  # where peers read or write its KV blocks

    @property
    def component(self) -> str:
        """ "namespace.component" of the worker that registered the card."""
        return self.endpoint.rsplit(".", 1)[0]

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes) -> ModelCard:
        return msgspec.json.decode(data, type=cls)


class KvTierStats(msgspec.Struct, kw_only=True):
    """A worker's KV tiers below its pool (`--kv-offload-gib`, `--kv-disk-dir`); counts are
    since it started."""

    host_blocks: int = 0
    host_bytes: int = 0
    host_capacity_bytes: int = 0
    # The disk tier's root, shared by the workers of a host: as of this worker's last scan of it,
    # plus what it wrote since.
    disk_blocks: int = 0
    disk_bytes: int = 0
    disk_capacity_bytes: int = 0
    disk_writable: bool = False
    offloaded_blocks: int = 0  # evicted from the pool and kept below it
    written_blocks: int = 0  # of which written to disk
    dropped_blocks: int = 0  # of which not written (too many waiting, the disk off or failing)
    rejected_blocks: int = 0  # disk files that failed verification, removed
    hit_blocks_host: int = 0  # blocks loaded into the pool from memory
    hit_blocks_disk: int = 0  # ... from disk
    loads: int = 0
    load_failures: int = 0  # loads that missed a block: those prompts were computed
    load_seconds: float = 0.0


class WorkerLoad(msgspec.Struct, kw_only=True):
    """A worker's `load_metrics` answer: its engine's stats (`EngineStats`) and its id."""

    instance_id: int
    waiting: int
    running: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_cache_hit_rate: float
    active_prefill_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, so far
    prefix_cache_hits: int = 0  # of which found
    kv_transfer_bytes: int = 0  # KV this worker read or wrote for disaggregation, so far
    kv_transfer_seconds: float = 0.0
    # Of those bytes, by backend ("shm", "tcp", "nixl"); of its transfers, those of some layers
    # of a prompt's blocks as it was computed (decode-first, `--kv-push layers`), and the blocks
    # moved with all their layers at once.
    kv_transfer_bytes_by_backend: dict[str, int] = msgspec.field(default_factory=dict)
    kv_layered_transfers: int = 0
    kv_whole_blocks: int = 0
    # Prompts whose KV this worker moved to or from a peer, and the time they waited on it
    # after the prompt was computed (a decode worker's read; decode-first, a prefill worker's
    # writes still running once the forward pass had ended, and those of cached blocks).
    kv_handoffs: int = 0
    kv_handoff_wait_seconds: float = 0.0
    kv_tiers: KvTierStats | None = None  # None: no tier below the pool
    # Requests this worker ended, so far, by how: the engine's finish reason ("stop", "length",
    # "abort"), "handed off" (a prefill worker's: its KV went on to a decode worker), "error",
    # or "cancelled" (the caller left before the end).
    requests_ended: dict[str, int] = msgspec.field(default_factory=dict)
    # Single decodes compiled (`--compile`): "on", "loading", "failed" or "off"; steps so far.
    compiled_decode: str = "off"
    compiled_decode_steps: int = 0
