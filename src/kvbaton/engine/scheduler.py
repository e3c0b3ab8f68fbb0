"""Continuous batching with a token budget. Never touches tensors.

A step's life:
1. running sequences first, in admission order: each gets the tokens it still has to compute
   (1 for a decode, a chunk of the prompt for a chunked prefill), within the step's token
   budget; if its blocks cannot be had, the newest running sequence is preempted (its blocks
   freed, its tokens to be recomputed later) until they can;
2. then waiting sequences, first come first served, while budget, sequence slots and blocks
   last; a new sequence first takes what the prefix cache holds of its prompt (none for one
   that wants its prompt's logprobs: it computes every position);
3. `update` after the forward pass: computed counts move up, sampled tokens are appended,
   finished sequences free their blocks.

Disaggregation: a waiting sequence with a `kv_source` is admitted by allocating blocks for the
part of its prompt that the prefix cache lacks, then waits in `loading` (its blocks neither
scheduled nor preemptible, nor registered in the prefix cache) until `finish_load`; a sequence
with `hold_kv` that samples its first token without stopping is HELD (in `held`), keeping its
blocks until `release` or `abort`. Both count against `max_num_seqs`. A failed load whose
blocks a writer may still write (`writes_end` not set) leaves them quarantined, out of every
table and of the free list, until `reclaim` finds its `writes_end` set; the sequence computes
its prompt in other blocks.

KV tiers: a waiting sequence without a `kv_source` whose next prompt blocks after the prefix
cache's are in the `tier` is admitted the same way, loading those blocks only (`KvLoad`'s
`block_hashes`); once loaded it computes the rest of its prompt.

Invariants:
- a held sequence's blocks and slot are freed exactly once: by the first of `release` and
  `abort`; the other then frees nothing.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from kvbaton.engine.block_manager import BlockManager
from kvbaton.engine.connector import KvLoad, KvSource, KvTier
from kvbaton.engine.sequence import Sequence, SequenceStatus
from kvbaton.llm.hashing import reusable_blocks

# The most prompt tokens a step computes of a prompt whose logprobs are read: its logits there
# are [chunk, vocabulary] float32 (512 x 128k: 256 MiB).
PROMPT_LOGPROBS_CHUNK = 512


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step, from seq.num_computed_tokens on
    samples: bool  # the step reaches the last known token: sample the next one


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        max_model_len: int,
        tier: KvTier | None = None,
    ) -> None:
        self.blocks = block_manager
        self.tier = tier
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}
        self.loads: list[KvLoad] = []  # admitted loads for the engine's loader to start
        # Blocks of failed loads that a writer may still write, until its event is set.
        self.quarantined: list[tuple[threading.Event, list[int]]] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.loading) + len(self.held)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a waiting, running, loading or held request; None if there is none (or it was
        aborted already).
        - A loading one keeps its blocks (a transfer may be writing them) until `finish_load`.
        - A held one frees its blocks and slot now: nobody read where its KV waits (its output
          went unread), or nobody wants it any more; a later `release` frees nothing."""
        seq = self.loading.get(request_id)
        if seq is not None:
            if seq.is_finished:
                return None
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
            return seq
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return seq
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self._finish(seq, "abort")
        return seq

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:
                i += 1
                continue
            while not self.blocks.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(self._scheduled(seq, n))
                budget -= n
                i += 1

        while self.waiting and budget > 0 and self.num_active < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            hits = self.blocks.match_prefix(seq) if not seq.block_table else []
            cached = len(hits) * self.blocks.block_size
            if seq.kv_source is not None and cached < seq.num_prompt_tokens:
                remote = seq.num_prompt_tokens - cached
                if not self._admit_load(seq, hits, seq.kv_source, remote):
                    break
                continue
            stored = self._tier_blocks(seq, len(hits))
            if stored and self.tier is not None:
                num_tokens = len(stored) * self.blocks.block_size
                if not self._admit_load(seq, hits, self.tier, num_tokens, stored):
                    break
                continue
            n = self._chunk(seq, seq.num_tokens - seq.num_computed_tokens - cached, budget)
            if n == 0 or not self.blocks.allocate(seq, n, hits):
                break
            self.waiting.popleft()
            self.blocks.note_prefix_lookup(seq.num_tokens, cached)
            seq.num_computed_tokens += cached
            if seq.num_cached_tokens == 0:
                seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._scheduled(seq, n))
            budget -= n
        return SchedulerOutput(scheduled, preempted)

    def _tier_blocks(self, seq: Sequence, num_hits: int) -> list[int]:
        """Hashes of the prompt blocks after the `num_hits` cached ones that the tier holds."""
        if (
            self.tier is None
            or seq.kv_source is not None
            or seq.block_table
            or seq.computes_whole_prompt
        ):
            return []
        bs = self.blocks.block_size
        hashes = seq.full_block_hashes(bs, reusable_blocks(seq.num_tokens, bs))[num_hits:]
        return hashes[: self.tier.lookup(hashes)] if hashes else []

    def _admit_load(
        self,
        seq: Sequence,
        hits: list[int],
        source: KvSource,
        num_tokens: int,
        block_hashes: list[int] | None = None,
    ) -> bool:
        """Admit `seq` to load `num_tokens` after its prefix-cache hits from `source`."""
        if not self.blocks.allocate(seq, num_tokens, hits, register=False):
            return False
        self.waiting.popleft()
        cached = len(hits) * self.blocks.block_size
        self.blocks.note_prefix_lookup(seq.num_prompt_tokens, cached)
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        seq.status = SequenceStatus.LOADING
        self.loading[seq.request_id] = seq
        dst = seq.block_table[len(hits) :]
        self.loads.append(KvLoad(seq.request_id, source, len(hits), dst, block_hashes or []))
        return True

    def finish_load(
        self,
        request_id: str,
        ok: bool,
        token_ids: list[int] | None = None,
        writes_end: threading.Event | None = None,
    ) -> Sequence | None:
        """A load ended; `token_ids` were sampled where the KV came from (decode-first: the
        first token), and are appended. Loaded: the prompt is computed; else it is computed
        here (from the prefix-cache hits on), in other blocks if a write may still land in the
        loaded ones (`writes_end` not set: they are quarantined). An aborted sequence frees its
        blocks now. Returns the sequence if it finished on the appended tokens (a stop token,
        max_tokens)."""
        seq = self.loading.pop(request_id, None)
        if seq is None:
            return None
        from_tier = seq.kv_source is None  # a peer's load names its source on the sequence
        seq.kv_source = None
        if not ok and writes_end is not None and not writes_end.is_set():
            hits = seq.num_computed_tokens // self.blocks.block_size  # blocks before the load's
            self.quarantined.append((writes_end, seq.block_table[hits:]))
            del seq.block_table[hits:]
        if seq.is_finished:
            self.blocks.deallocate(seq)
            return None
        if ok and from_tier:  # its full blocks loaded, counted as cached; the rest is computed
            loaded = len(seq.block_table) * self.blocks.block_size
            seq.num_cached_tokens += loaded - seq.num_computed_tokens
            seq.num_computed_tokens = loaded
        elif ok:
            seq.num_computed_tokens = seq.num_prompt_tokens
        if ok:
            self.blocks.register_computed(seq)
        for token in token_ids or []:
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                return seq
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return None

    def reclaim(self) -> int:
        """Free the quarantined blocks that no write can land in any more; how many."""
        freed = 0
        for entry in list(self.quarantined):
            writes_end, blocks = entry
            if writes_end.is_set():
                self.quarantined.remove(entry)
                self.blocks.release_blocks(blocks)
                freed += len(blocks)
        return freed

    def release(self, request_id: str) -> bool:
        """Free a held sequence's blocks; False if none is held under the id."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.blocks.deallocate(seq)
        return seq is not None

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Apply a step's results; returns the sequences that finished in it (held ones among
        them)."""
        finished = []
        for item in output.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_tokens
            token = sampled.get(seq.request_id)
            if token is None:
                continue
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
            elif seq.hold_kv:
                self.running.remove(seq)
                seq.status = SequenceStatus.HELD
                self.held[seq.request_id] = seq
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in seq.stop_token_ids and seq.num_output_tokens > params.min_tokens:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _chunk(self, seq: Sequence, remaining: int, budget: int) -> int:
        """Tokens to compute this step. Without chunked prefill a prompt waits for a budget
        that holds it whole; a preempted sequence's recompute (prompt and output, possibly
        longer than any budget) is chunked regardless, or it could never run again; so is a
        prompt whose logprobs are read, by `PROMPT_LOGPROBS_CHUNK` (its logits are [chunk,
        vocabulary] floats)."""
        if seq.computes_whole_prompt:
            return min(remaining, budget, PROMPT_LOGPROBS_CHUNK)
        if remaining <= budget:
            return remaining
        return budget if self.enable_chunked_prefill or seq.num_output_tokens else 0

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSeq:
        return ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; its known tokens are recomputed when it runs again."""
        self.blocks.deallocate(seq)
        self.num_preemptions += 1
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.blocks.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
