"""One request's state inside the engine.

Accounting follows "computed tokens catch up with known tokens": `token_ids` holds every known
token (prompt, then output), `num_computed_tokens` how many of them have their KV in the cache.
A step computes some of the rest; when a step brings `num_computed_tokens` up to `num_tokens`, the
model's output at the last position is sampled and appended. Prefix-cache hits (and, later, KV
received from a prefill worker) are tokens that became computed without a forward pass.

The KV connector (`connector.py`) adds two lives: a sequence with `hold_kv` is HELD after its
first token, its blocks kept for a peer to read until released; one with a `kv_source` waits in
LOADING while its prompt's KV is loaded into its blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvbaton.engine.connector import KvSink, KvSource
from kvbaton.engine.thinking_budget import ThinkingState
from kvbaton.llm.hashing import block_extra_keys, hash_blocks
from kvbaton.protocols.llm import SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # blocks allocated, the prompt's KV being loaded (`kv_source`)
    HELD = "held"  # ended after its first token, its blocks kept (`hold_kv`)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()  # EOS and the request's stop ids
    cache_salt: str | None = None
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    prefix_hint_tokens: int = 0  # ... found there when it arrived (a waiting request's load)
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    # With `params.logprobs`: entry i is output token `logprobs_from + i`'s (those before were
    # sampled and handed to the caller elsewhere: a prefill worker's first token).
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    logprobs_from: int = 0
    # With `params.prompt_logprobs`: entry i is prompt token i + 1's (from position i's logits).
    prompt_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    num_emitted_tokens: int = 0  # output tokens already handed to the caller
    hold_kv: bool = False  # end after the first token, blocks held for a decode worker
    kv_source: KvSource | None = None  # where the prompt's KV is loaded from
    kv_sink: KvSink | None = None  # told of each layer of the prompt's KV as it is written
    matcher: Any = None  # its constraint's state (`guided.py`), if it has one
    broken: str | None = None  # why its constraint refused its last token: it is aborted
    thinking: ThinkingState | None = None  # its thinking budget's state, if it has one

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def extra_keys(self) -> tuple[Any, ...] | None:
        return block_extra_keys(self.cache_salt)

    @property
    def computes_whole_prompt(self) -> bool:
        """It reads the logits of every prompt position: no prompt KV is reused."""
        return self.params.prompt_logprobs is not None

    def unrecorded_prompt_rows(self, num_tokens: int) -> range:
        """The prompt positions a step computing `num_tokens` from `num_computed_tokens` gives
        logprobs of that are not recorded yet (none on a recompute, none without
        `prompt_logprobs`; the last prompt position predicts an output, not a prompt token)."""
        if not self.computes_whole_prompt:
            return range(0)
        first = max(self.num_computed_tokens, len(self.prompt_logprobs))
        return range(first, min(self.num_computed_tokens + num_tokens, self.num_prompt_tokens - 1))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def placed_token(self) -> int | None:
        """The token its thinking budget places next, or None (the model draws)."""
        if self.thinking is None:
            return None
        return self.thinking.placed(
            self.token_ids, self.num_prompt_tokens - self.thinking.budget.replay
        )

    @property
    def is_finished(self) -> bool:
        """Finished, or held (it runs no more either way)."""
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.HELD)

    def full_block_hashes(self, block_size: int, num_blocks: int) -> list[int]:
        """Hashes of the first `num_blocks` full blocks (computed once, then extended)."""
        hashes = self.block_hashes
        done = len(hashes)
        if done < num_blocks:
            tokens = self.token_ids[done * block_size : num_blocks * block_size]
            assert len(tokens) == (num_blocks - done) * block_size, "only full blocks are hashed"
            parent = hashes[-1] if hashes else None
            hashes += hash_blocks(tokens, block_size, self.extra_keys, parent)
        return hashes[:num_blocks]
