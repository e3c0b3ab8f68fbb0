"""The engine core: `step()` is schedule -> run -> update, nothing else. Synchronous and
single-threaded; `AsyncEngine` runs it on a thread of its own for workers.

The run is a `StepRunner`: the model runner (a forward pass and a sampler), or a stand-in with
the same face (the mocker's timing model). Scheduler and block manager are the same for both.

With a KV tier (`connector.KvTier`), a step hands it the blocks its schedule evicted before
anything writes them: before the loads it admitted start, and before its forward pass."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvbaton.engine.block_manager import BlockManager
from kvbaton.engine.config import EngineConfig
from kvbaton.engine.connector import EmitEvent, EngineRequest, KvCacheView, KvLoad, KvTier
from kvbaton.engine.scheduler import Scheduler, SchedulerOutput
from kvbaton.engine.sequence import Sequence, SequenceStatus
from kvbaton.engine.thinking_budget import ThinkingState
from kvbaton.llm.model_files import resolve_model
from kvbaton.protocols.kv import KvDump, KvEvent
from kvbaton.protocols.llm import EngineOutput, KvTierStats, SamplingParams, Usage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    kv_blocks_total: int
    # Blocks held by requests (running, or a prefill's KV held for its decode worker), a block
    # shared by several once: what a router's own count of the requests it sent measures too.
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_cache_hit_rate: float
    # Prompt tokens admitted or waiting, not yet computed (of a waiting request, those the
    # prefix cache will not give it).
    active_prefill_tokens: int = 0
    # Prompt tokens of admitted requests looked up in the prefix cache, and found there, so far.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_tiers: KvTierStats | None = None
    # Single decodes on the compiled package (`EngineConfig.compile`): "on", "loading",
    # "failed" or "off" (`ModelRunner.compiled_decode`), and the steps run on it so far.
    compiled_decode: str = "off"
    compiled_decode_steps: int = 0


@dataclass(frozen=True)
class StepRun:
    """A step scheduled and run, its tokens not yet taken in (`LLMEngine.end_step`)."""

    scheduled: SchedulerOutput
    sampled: dict[str, int]


class StepRunner(Protocol):
    """Runs one scheduled step: the sampled token of each sequence that samples, by id."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]

    def execute(self, output: SchedulerOutput) -> dict[str, int]: ...
    def forget(self, request_id: str) -> None: ...


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        on_kv_event: Callable[[KvEvent], None] | None = None,
        runner: StepRunner | None = None,
        cache_buffer: Callable[[int], memoryview] | None = None,
        host_mirror: bool = False,
        kv_tier: Callable[[KvCacheView, EmitEvent], KvTier] | None = None,
    ) -> None:
        """With no `runner`, the model runner on `config.model` with a KV cache of
        `config.num_kv_blocks` blocks (else as many as `kv_cache_gib` holds), its blocks in the
        host buffer `cache_buffer(nbytes)` gives if given (`ModelRunner.allocate_cache`); a
        given runner needs `num_kv_blocks`. `kv_tier(view, emit)`: the tier below the pool."""
        self.config = config
        self.model_dir = resolve_model(config.model)
        model_runner = None
        if runner is None:
            from kvbaton.engine.model_runner import ModelRunner  # torch only for the model

            model_runner = ModelRunner.create(self.model_dir, config, cache_buffer, host_mirror)
            num_blocks = model_runner.num_blocks
            runner = model_runner
        elif config.num_kv_blocks is None:
            raise ValueError("a stand-in runner needs num_kv_blocks")
        else:
            num_blocks = config.num_kv_blocks
        self.runner = runner
        self.model_runner = model_runner
        self.guided = model_runner.guided if model_runner else None  # a stand-in ignores it
        self.max_model_len = runner.max_model_len
        self.blocks = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            on_kv_event,
            keep_evicted=kv_tier is not None,
        )
        self.tier = kv_tier(self.kv_cache(), self.blocks.emit) if kv_tier is not None else None
        self.scheduler = Scheduler(
            self.blocks,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            self.max_model_len,
            self.tier,
        )
        self.eos_token_ids = runner.eos_token_ids
        self.vocab_size = runner.vocab_size
        self._requests: dict[str, Sequence] = {}
        self.last_step_tokens = 0
        # Called with the loads a step admitted, before its forward pass (else: take_kv_loads).
        self.on_kv_loads: Callable[[list[KvLoad]], None] | None = None
        log.info(
            "engine ready: %s on %s, %d KV blocks of %d tokens, max_model_len %d",
            self.model_dir.name,
            f"{config.dtype} {config.device}" if model_runner else type(runner).__name__,
            num_blocks,
            config.block_size,
            self.max_model_len,
        )

    # -- requests ----------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request could never run here."""
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens; this model's context is "
                f"{self.max_model_len} (including at least one output token)"
            )
        if any(t < 0 or t >= self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        if params.guided is not None and params.guided.replay > n:
            raise ValueError("the constraint replays more tokens than the prompt has")
        if (budget := params.thinking_budget) is not None:
            if budget.replay > n:
                raise ValueError("the thinking budget replays more tokens than the prompt has")
            tags = [budget.end] if budget.start is None else [budget.start, budget.end]
            if any(t < 0 or t >= self.vocab_size for t in tags):
                raise ValueError(
                    f"thinking budget tags must be token ids in [0, {self.vocab_size})"
                )
        if any(t < 0 or t >= self.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {self.vocab_size})")
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            raise ValueError(
                f"the prompt has {n} tokens, over max_num_batched_tokens "
                f"{self.config.max_num_batched_tokens} without chunked prefill"
            )
        longest = min(n + params.max_tokens, self.max_model_len)
        if self.blocks.blocks_needed(longest) > self.blocks.num_blocks:
            raise ValueError(
                f"{longest} tokens need more KV blocks than this engine has "
                f"({self.blocks.num_blocks} of {self.config.block_size})"
            )

    def add_request(self, request: EngineRequest) -> None:
        """Queue `request` (the KV connector's fields: `connector.py`; a stand-in runner tells
        a `kv_sink` of no layer). ValueError if it could never run."""
        request_id, prompt_token_ids, params = (
            request.request_id,
            request.prompt_token_ids,
            request.params,
        )
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        self.check_request(prompt_token_ids, params)
        known = list(request.output_token_ids)
        if len(known) >= params.max_tokens or any(t < 0 or t >= self.vocab_size for t in known):
            raise ValueError("the output tokens given must be valid and fewer than max_tokens")
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.eos_token_ids
        seq = Sequence(
            request_id,
            list(prompt_token_ids) + known,
            params,
            frozenset(stop),
            cache_salt=request.cache_salt,
            num_prompt_tokens=len(prompt_token_ids),
            num_emitted_tokens=len(known),
            logprobs_from=len(known),
            hold_kv=request.hold_kv,
            kv_source=request.kv_source,
            kv_sink=request.kv_sink,
        )
        if params.guided is not None and self.guided is not None:
            replayed = prompt_token_ids[len(prompt_token_ids) - params.guided.replay :]
            seq.matcher = self.guided.matcher(params.guided, replayed + known)
        if params.thinking_budget is not None:
            seq.thinking = ThinkingState(params.thinking_budget)
        seq.prefix_hint_tokens = len(self.blocks.match_prefix(seq)) * self.config.block_size
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> EngineOutput | None:
        """Stop a request and free its blocks now (a held one's too: see `Scheduler.abort`);
        its final output, or None if unknown."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        return self._output(self._forget(seq), [])

    def has_unfinished(self) -> bool:
        """Requests wait or run (loading and held ones need no step)."""
        return self.scheduler.has_unfinished()

    # -- disaggregation ----------------------------------------------------------------------
    def take_kv_loads(self) -> list[KvLoad]:
        """Loads admitted since the last call; each must end in `finish_kv_load`."""
        loads, self.scheduler.loads = self.scheduler.loads, []
        return loads

    def finish_kv_load(
        self,
        request_id: str,
        ok: bool,
        token_ids: list[int] | None = None,
        writes_end: threading.Event | None = None,
    ) -> EngineOutput | None:
        """A load ended: the request runs on (with its prompt computed here if not `ok`, in
        other blocks while `writes_end` is not set), after `token_ids` sampled at the source;
        its final output if those finished it."""
        loading = self._requests.get(request_id)
        matcher = loading.matcher if loading is not None else None
        if token_ids and matcher is not None and not matcher.consume_tokens(token_ids):
            log.error("request %s: tokens sampled at the source break its constraint", request_id)
        seq = self.scheduler.finish_load(request_id, ok, token_ids, writes_end)
        if seq is None:
            return None
        return self._output(self._forget(seq), seq.output_token_ids[seq.num_emitted_tokens :])

    def release_kv(self, request_id: str) -> bool:
        """Free a held request's blocks (its KV was read, or nobody came for it); False if none
        is held under the id (released or aborted before)."""
        return self.scheduler.release(request_id)

    def reclaim_kv_blocks(self) -> int:
        """Free the blocks of failed loads that no write can land in any more; how many."""
        return self.scheduler.reclaim()

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        return self.end_step(self.begin_step())

    def begin_step(self) -> StepRun:
        """Schedule a step and run it: its tokens are sampled, not yet taken in. Until
        `end_step`, the scheduler shows the step's requests running, as during a forward pass."""
        scheduled = self.scheduler.schedule()
        if self.tier is not None and self.blocks.evicted:
            self.tier.offload(self.blocks.take_evicted())
        if self.on_kv_loads is not None and self.scheduler.loads:
            self.on_kv_loads(self.take_kv_loads())  # they overlap the forward pass
        try:
            sampled = self.runner.execute(scheduled)
        except BaseException:
            # Blocks of this step were registered before their KV was written: forget every
            # cached prefix rather than serve a wrong one.
            self.blocks.clear_kv_blocks()
            raise
        return StepRun(scheduled, sampled)

    def end_step(self, run: StepRun) -> list[EngineOutput]:
        """Take a run step's tokens in; the outputs of its requests."""
        scheduled, sampled = run.scheduled, run.sampled
        finished = {s.request_id for s in self.scheduler.update(scheduled, sampled)}
        self.last_step_tokens = scheduled.num_tokens
        outputs = []
        for item in scheduled.scheduled:
            seq = item.seq
            if seq.request_id in sampled:
                new = seq.output_token_ids[seq.num_emitted_tokens :]
                if seq.request_id in finished:
                    self._forget(seq)
                outputs.append(self._output(seq, new))
            if seq.broken is not None and not seq.is_finished:  # this request only
                log.warning("request %s aborted: %s", seq.request_id, seq.broken)
                final = self.abort_request(seq.request_id)
                if final is not None:
                    outputs.append(final)
        return outputs

    def _forget(self, seq: Sequence) -> Sequence:
        self._requests.pop(seq.request_id, None)
        self.runner.forget(seq.request_id)
        return seq

    def _output(self, seq: Sequence, new: list[int]) -> EngineOutput:
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = seq.logprobs[seq.num_emitted_tokens - seq.logprobs_from :]
        first = seq.num_emitted_tokens == 0 and seq.computes_whole_prompt
        seq.num_emitted_tokens += len(new)
        usage = None
        held = seq.status is SequenceStatus.HELD
        if seq.is_finished:
            usage = Usage(
                prompt_tokens=seq.num_prompt_tokens,
                completion_tokens=seq.num_output_tokens,
                cached_tokens=seq.num_cached_tokens,
            )
        return EngineOutput(
            request_id=seq.request_id,
            token_ids=new,
            finish_reason=seq.finish_reason,
            usage=usage,
            logprobs=logprobs,
            prompt_logprobs=seq.prompt_logprobs if first else None,
            kv_blocks=list(seq.block_table) if held else None,
        )

    def kv_cache(self) -> KvCacheView:
        """The KV cache as a transfer layer sees it."""
        r = self.model_runner
        if r is None:  # a stand-in runner: blocks with no bytes
            return KvCacheView(type(self.runner).__name__, self.blocks.num_blocks, 0, None)
        per_block = r.model.kv_bytes_per_block(r.block_size)
        return KvCacheView(
            r.kv_layout(),
            r.num_blocks,
            per_block,
            r.cache_buffer,
            r.mirror is not None,
            r.stage_out,
            r.stage_in,
            r.model.config.num_layers,
        )

    def clear_kv_blocks(self) -> int:
        """Forget every cached prefix, the pool's and what this process keeps in its tier."""
        if self.tier is not None:
            self.tier.forget()
        return self.blocks.clear_kv_blocks()

    def kv_dump(self) -> KvDump:
        """Every cached block, as of the last event sent."""
        return self.blocks.dump(self.tier.fill_dump if self.tier is not None else None)

    def stats(self) -> EngineStats:
        """Call from the thread that steps the engine (it reads the queues)."""
        b = self.blocks.stats()
        runner = self.model_runner
        compiled = runner.compiled if runner is not None else None
        prefill = 0
        for queue in (self.scheduler.waiting, self.scheduler.running):
            for seq in queue:
                if seq.num_computed_tokens < seq.num_prompt_tokens:
                    computed = seq.num_computed_tokens
                    if not seq.block_table:  # not admitted: the prefix cache will give some
                        computed = seq.prefix_hint_tokens  # (looked up once, at arrival)
                    prefill += seq.num_tokens - computed
        return EngineStats(
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            kv_blocks_total=b.total,
            kv_blocks_used=b.used,
            kv_blocks_free=b.free,
            prefix_cache_hit_rate=self.blocks.prefix_hit_rate,
            active_prefill_tokens=prefill,
            prefix_cache_queries=self.blocks.prefix_queries,
            prefix_cache_hits=self.blocks.prefix_hits,
            kv_tiers=self.tier.stats() if self.tier is not None else None,
            compiled_decode=runner.compiled_decode if runner is not None else "off",
            compiled_decode_steps=compiled.steps if compiled is not None else 0,
        )
