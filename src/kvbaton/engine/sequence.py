"""One request's state inside the engine.

Accounting follows "computed tokens catch up with known tokens": `token_ids` holds every known
token (prompt, then output), `num_computed_tokens` how many of them have their KV in the cache.
A step computes some of the rest; when a step brings `num_computed_tokens` up to `num_tokens`, the
model's output at the last position is sampled and appended. Prefix-cache hits (and, later, KV
received from a prefill worker) are tokens that became computed without a forward pass.

Disaggregation adds two lives: a prefill worker's sequence with `hold_kv` ends after its first
token with its blocks still held (for a decode worker to read, until released); a decode
worker's sequence with `kv_source` arrives with its prompt and first token, and waits in
LOADING while its prompt's KV is read from the prefill worker into its blocks. A sequence with a
`kv_sink` is told of each layer of its prompt's KV as a step writes it into the cache (the
decode-first order streams it to the decode worker as it is computed).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvbaton.llm.hashing import block_extra_keys, hash_blocks
from kvbaton.protocols.llm import SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # blocks allocated, the prompt's KV being read from a prefill worker
    FINISHED = "finished"


@dataclass(frozen=True)
class PromptChunk:
    """Prompt tokens [start, end) computed in one step, in blocks `block_ids`: the sequence's
    blocks `first_block...` at that step (the blocks that hold those tokens)."""

    start: int
    end: int
    first_block: int
    block_ids: list[int]


class KvSink(Protocol):
    def layer_written(self, chunk: PromptChunk, layer: int) -> None:
        """Called on the engine's thread once a step wrote layer `layer`'s K and V of `chunk`
        into the cache, before the next layer's (layers in order, every layer of a chunk; a
        chunk may be computed again after a preemption, in other blocks). Must not block; the
        blocks stay the sequence's until its step ends, no longer."""
        ...


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()  # EOS and the request's stop ids
    lora_name: str | None = None
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
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    num_emitted_tokens: int = 0  # output tokens already handed to the caller
    hold_kv: bool = False  # end after the first token, blocks held for a decode worker
    kv_source: object = None  # where the prompt's KV is (opaque here; given to the loader)
    kv_sink: KvSink | None = None  # told of each layer of the prompt's KV as it is written

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def extra_keys(self) -> tuple[Any, ...] | None:
        return block_extra_keys(self.lora_name, self.cache_salt)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

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
