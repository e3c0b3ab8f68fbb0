"""Continuous batching with a token budget. Never touches tensors.

A step's life:
1. running sequences first, in admission order: each gets the tokens it still has to compute
   (1 for a decode, a chunk of the prompt for a chunked prefill), within the step's token
   budget; if its blocks cannot be had, the newest running sequence is preempted (its blocks
   freed, its tokens to be recomputed later) until they can;
2. then waiting sequences, first come first served, while budget, sequence slots and blocks
   last; a new sequence first takes what the prefix cache holds of its prompt;
3. `update` after the forward pass: computed counts move up, sampled tokens are appended,
   finished sequences free their blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvbaton.engine.block_manager import BlockManager
from kvbaton.engine.sequence import Sequence, SequenceStatus


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
    ) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return seq
        return None

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

        while (
            self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted
        ):
            seq = self.waiting[0]
            hits = self.blocks.match_prefix(seq) if not seq.block_table else []
            cached = len(hits) * self.blocks.block_size
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

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Apply a step's results; returns the sequences that finished in it."""
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
        longer than any budget) is chunked regardless, or it could never run again."""
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
