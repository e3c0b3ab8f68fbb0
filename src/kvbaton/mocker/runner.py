"""The mocker's step runner: the engine's scheduler and block manager decide what a step does,
this runner only waits as long as the step would take (`MockerTiming`) and picks its tokens.

Invariants: each output token depends only on the tokens before it (prompt and outputs) and the
request's seed (deterministic across runs, batches and processes; a request migrated with its
outputs so far appended to its prompt goes on with the tokens it would have had); they are never
a special token of the model's tokenizer, and never EOS (like Dynamo's mocker, a request runs to
`max_tokens` unless a stop token id of its own comes up).
- Logprobs, where asked for, come from a mocked distribution at each position (`_mocked`): the
  position's token (the one picked, or the prompt's) at 1/2, the ids after it at 1/4, 1/8, ...;
  listed as the engine lists them (the token, then the `top` likeliest), one entry per output
  token and per prompt token after the first."""

from __future__ import annotations

import hashlib
import json
import math
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbaton.engine.async_engine import AsyncEngine
from kvbaton.engine.block_manager import BlockManager
from kvbaton.engine.config import MOCKER_DEFAULTS, EngineConfig
from kvbaton.engine.engine import LLMEngine
from kvbaton.engine.scheduler import SchedulerOutput
from kvbaton.engine.sequence import Sequence
from kvbaton.kv_tiers import TierSettings
from kvbaton.llm.model_files import eos_token_ids, resolve_model
from kvbaton.mocker.async_engine import MockerAsyncEngine
from kvbaton.mocker.tiers import mocker_tiers
from kvbaton.mocker.timing import MockerTiming
from kvbaton.protocols.kv import KvEvent
from kvbaton.protocols.llm import TokenLogprob

_MASK = (1 << 64) - 1
_HALF = math.log(0.5)


def _mix(x: int) -> int:
    """splitmix64's finalizer: consecutive inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _model_facts(model_dir: Path) -> tuple[int, int, set[int]]:
    """(vocab size, max positions, ids never to emit: EOS and the tokenizer's added tokens)."""
    config = json.loads((model_dir / "config.json").read_text())
    never = set(eos_token_ids(config.get("eos_token_id")))
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        added = json.loads(tokenizer_file.read_text()).get("added_tokens", [])
        never |= {int(t["id"]) for t in added}
    return int(config["vocab_size"]), int(config.get("max_position_embeddings", 4096)), never


class MockerRunner:
    def __init__(
        self,
        model_dir: Path,
        timing: MockerTiming,
        max_model_len: int | None = None,
    ) -> None:
        """Steps take no time here: `busy_seconds` adds up what they would take, and the
        engine's loop (`MockerAsyncEngine`) waits it."""
        vocab_size, max_positions, never = _model_facts(model_dir)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len or max_positions
        self.eos_token_ids: frozenset[int] = frozenset()
        self.timing = timing
        self.blocks: BlockManager | None = None  # set once the engine made it: KV usage
        self._choices = [t for t in range(vocab_size) if t not in never]
        if not self._choices:
            raise ValueError(f"{model_dir} leaves no token id to generate")
        self._hashes: dict[str, Any] = {}  # request id -> blake2b of its seed and tokens so far
        self.busy_seconds = 0.0  # simulated time of all steps so far

    def step_seconds(self, output: SchedulerOutput) -> float:
        prefill = decodes = 0
        for item in output.scheduled:
            seq = item.seq
            if item.num_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                decodes += 1
            else:
                prefill += item.num_tokens
        usage = 0.0
        if self.blocks is not None:
            usage = (self.blocks.num_blocks - self.blocks.num_free_blocks) / self.blocks.num_blocks
        return self.timing.step_seconds(prefill, decodes, usage)

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        if not output.scheduled:
            return {}
        seconds = self.step_seconds(output)
        self.busy_seconds += seconds
        tokens = {}
        for item in output.scheduled:
            seq = item.seq
            top = seq.params.prompt_logprobs or 0
            seq.prompt_logprobs += [
                self._mocked(seq.token_ids[i + 1], top, rank=1)
                for i in seq.unrecorded_prompt_rows(item.num_tokens)
            ]
            if item.samples:
                token = tokens[seq.request_id] = self._token(seq)
                if seq.params.logprobs is not None:
                    seq.logprobs.append(self._mocked(token, seq.params.logprobs, rank=0))
        return tokens

    def forget(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)

    def _mocked(self, token: int, top: int, rank: int) -> list[TokenLogprob]:
        """`token`'s entry in its position's mocked distribution (see the module's docstring),
        ranked `rank`: 1 for a prompt token (the likeliest there), 0 for an output (not known,
        as the engine gives it)."""
        best = [TokenLogprob((token + k) % self.vocab_size, _HALF * (k + 1)) for k in range(top)]
        return [TokenLogprob(token, _HALF, rank), *best]

    def _token(self, seq: Sequence) -> int:
        """A token from the hash of the seed and every token before it. The hash is kept per
        request and extended by each token it picks (blake2b's updates compose: hashing
        a then b equals hashing a + b), so a token costs O(1), not O(length)."""
        digest = self._hashes.get(seq.request_id)
        if digest is None:
            digest = hashlib.blake2b(str(seq.params.seed).encode(), digest_size=8)
            digest.update(array("I", seq.token_ids).tobytes())
            self._hashes[seq.request_id] = digest
        value = int.from_bytes(digest.copy().digest(), "little")
        token = self._choices[_mix(value) % len(self._choices)]
        digest.update(array("I", (token,)).tobytes())
        return token


def mocker_config(**overrides: object) -> EngineConfig:
    """An engine config with the mocker's defaults under `overrides` (None: the default)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return EngineConfig(**{**MOCKER_DEFAULTS, **given})  # type: ignore[arg-type]


async def create_mocker_engine(
    config: EngineConfig,
    timing: MockerTiming,
    on_kv_event: Callable[[KvEvent], None] | None = None,
    tiers: TierSettings | None = None,
) -> AsyncEngine:
    model_dir = resolve_model(config.model)
    runner = MockerRunner(model_dir, timing, config.max_model_len)
    kv_tier = None
    if tiers is not None and tiers.enabled:
        kv_tier = mocker_tiers(tiers, model_dir, config.block_size, timing)
    engine = LLMEngine(config, on_kv_event, runner, kv_tier=kv_tier)
    runner.blocks = engine.blocks
    return MockerAsyncEngine(engine, runner)
