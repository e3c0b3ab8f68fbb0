"""Turns the logits of a step into one token per sampling sequence.

- Order, as in vLLM: penalties (repetition on prompt and output, frequency and presence on
  the output), the logit bias, the min_tokens mask on stop tokens, a constraint's mask
  (`guided.py`), then greedy argmax, or temperature, top-k, top-p, min-p and a draw.
- A request with a seed draws from its own generator: its tokens do not depend on what else is
  in the batch.
- A token its thinking budget places (`thinking_budget.py`) replaces the one drawn.
- Logprobs are those of the raw model output; so are a prompt's (`record_prompt_logprobs`).
- A token that its constraint refuses (an llguidance fault: the mask allows only what it
  takes) marks its sequence `broken`; the engine aborts that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbaton.engine.guided import GuidedDecoding
from kvbaton.engine.sequence import Sequence
from kvbaton.protocols.llm import TokenLogprob


@dataclass(frozen=True)
class PromptRows:
    """Positions [first, first + count) of a sequence's prompt whose logits give the logprobs
    of the prompt tokens after them."""

    seq: Sequence
    first: int
    count: int


class Sampler:
    def __init__(
        self, seed: int, device: torch.device, guided: GuidedDecoding | None = None
    ) -> None:
        self.device = device
        self.guided = guided
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._seeded.pop(request_id, None)

    def _generator(self, seq: Sequence, vocab_size: int) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        gen = self._seeded.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self._seeded[seq.request_id] = gen
            # Tokens sampled elsewhere (a prefill worker's first token) drew from the same
            # seed there: draw as many here, so the next token is the one serving the request
            # whole would draw. A draw's use of the generator depends on the vocabulary's size
            # only, not on the probabilities.
            uniform = torch.ones(vocab_size, device=self.device)
            for _ in range(seq.num_output_tokens):
                torch.multinomial(uniform, 1, generator=gen)
        return gen

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Sample a token per row; appends each row's logprobs to its sequence if asked for."""
        raw = logits
        penalties = [self._penalties(seq) for seq in seqs]
        if any(any(which) for which in penalties):
            logits = logits.clone()
            for row, (seq, which) in enumerate(zip(seqs, penalties, strict=True)):
                if any(which):
                    self._penalize(logits[row], seq, which)
        constrained = [(i, s.matcher) for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained:
            assert self.guided is not None
            logits = logits.clone() if logits is raw else logits
            self.guided.mask(logits, constrained)
        tokens = [0] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if greedy:
            rows = logits if len(greedy) == len(seqs) else logits[greedy]
            picked = rows.argmax(dim=-1).tolist()
            for i, token in zip(greedy, picked, strict=True):
                tokens[i] = token
        for i, seq in enumerate(seqs):
            if not seq.params.greedy:
                tokens[i] = self._draw(logits[i], seq)
            if (placed := seq.placed_token()) is not None:
                tokens[i] = placed  # (drawn all the same: a seeded draw stays in step)
        for i, matcher in constrained:
            if not matcher.consume_token(tokens[i]):  # its row alone fails (the engine aborts it)
                seqs[i].broken = f"token {tokens[i]} breaks the constraint: {matcher.get_error()}"
        wants = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if wants:
            logprobs = torch.log_softmax(raw[wants], dim=-1)
            tops = [seqs[i].params.logprobs or 0 for i in wants]
            entries = _entries(logprobs, [tokens[i] for i in wants], max(tops))
            for i, top, entry in zip(wants, tops, entries, strict=True):
                seqs[i].logprobs.append(entry[: 1 + top])
        return tokens

    @staticmethod
    def record_prompt_logprobs(logits: torch.Tensor, spans: list[PromptRows]) -> None:
        """Append each span's prompt logprobs to its sequence: `logits` holds the spans' rows
        one after the other, in order."""
        row = 0
        for span in spans:
            seq, end = span.seq, span.first + span.count
            logprobs = torch.log_softmax(logits[row : row + span.count], dim=-1)
            targets = seq.token_ids[span.first + 1 : end + 1]
            top = seq.params.prompt_logprobs or 0
            seq.prompt_logprobs += _entries(logprobs, targets, top, ranked=True)
            row += span.count

    @staticmethod
    def _penalties(seq: Sequence) -> tuple[bool, bool, bool, bool]:
        """Which apply now: repetition; frequency or presence; the logit bias; the min_tokens
        mask."""
        p = seq.params
        return (
            p.repetition_penalty != 1.0,
            bool((p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens),
            bool(p.logit_bias),
            bool(seq.num_output_tokens < p.min_tokens and seq.stop_token_ids),
        )

    def _penalize(
        self, row: torch.Tensor, seq: Sequence, which: tuple[bool, bool, bool, bool]
    ) -> None:
        """Apply `which` of the penalties (`_penalties(seq)`) to the row in place."""
        p = seq.params
        repetition, frequency, bias, min_tokens = which
        if repetition:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=row.device)
            values = row[seen]
            row[seen] = torch.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )
        if frequency:
            out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
            row[ids] += torch.tensor(
                list(p.logit_bias.values()), dtype=row.dtype, device=row.device
            )
        if min_tokens:
            row[list(seq.stop_token_ids)] = float("-inf")

    def _draw(self, row: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = row.topk(p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(0)
            drop = cumulative - sorted_probs > p.top_p  # keep the smallest set reaching top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs, 1, generator=self._generator(seq, probs.shape[0])))


def _entries(
    logprobs: torch.Tensor, tokens: list[int], top: int, ranked: bool = False
) -> list[list[TokenLogprob]]:
    """Per row of `logprobs`: its token's logprob (and, if `ranked`, its rank as vLLM counts
    it: how many tokens are at least as likely), then the `top` best."""
    index = torch.tensor(tokens, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, index)
    ranks = (logprobs >= chosen).sum(dim=1).tolist() if ranked else [0] * len(tokens)
    entries = [
        [TokenLogprob(t, lp, rank)]
        for t, lp, rank in zip(tokens, chosen[:, 0].tolist(), ranks, strict=True)
    ]
    if top:
        values, ids = logprobs.topk(top, dim=-1)
        for entry, row_ids, row_values in zip(entries, ids.tolist(), values.tolist(), strict=True):
            entry += [TokenLogprob(t, v) for t, v in zip(row_ids, row_values, strict=True)]
    return entries
