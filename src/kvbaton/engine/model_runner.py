"""Runs one scheduled step on the model: builds the step's tensors from block tables, calls the
forward pass, samples. Owns the model, the KV cache and the sampler."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from kvbaton.engine.compiled_decode import CompiledDecode
from kvbaton.engine.config import EngineConfig
from kvbaton.engine.connector import KvSink, PromptChunk
from kvbaton.engine.decode_package import (
    BuildFailed,
    LoadFailed,
    PackageLoad,
    PackageSpec,
    TooLargeToLoad,
    built_package,
    load_fitting,
)
from kvbaton.engine.guided import GuidedDecoding
from kvbaton.engine.host_allocator import retain_freed_memory
from kvbaton.engine.model import (
    LlamaModel,
    ModelConfig,
    PrefillSpan,
    StepBatch,
    amx_available,
    fp16_gemm_available,
    onednn_bf16_available,
)
from kvbaton.engine.sampler import PromptRows, Sampler
from kvbaton.engine.scheduler import ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KERNEL_NEEDS = {"fbgemm-fp16": "FBGEMM (x86)", "onednn-bf16": "oneDNN's bfloat16 GEMMs (AVX-512)"}


def projection_kernel(choice: str, dtype: torch.dtype, device: torch.device) -> str:
    """The projections' kernel (one of model.KERNELS; see model.py) for an `EngineConfig.matmul`.
    "auto": for bfloat16 on a CPU, oneDNN's alone where it runs on AMX, else every prepacked
    kernel this CPU and PyTorch have; "native" otherwise."""
    if choice == "native":
        return "native"
    bf16_cpu = device.type == "cpu" and dtype == torch.bfloat16
    have = {"fbgemm-fp16": fp16_gemm_available(), "onednn-bf16": onednn_bf16_available()}
    if choice == "auto":
        if bf16_cpu and have["onednn-bf16"] and amx_available():
            return "onednn-bf16"
        usable = [kernel for kernel, ok in have.items() if ok and bf16_cpu]
        return "+".join(usable) or "native"
    kernels = choice.split("+")
    if not bf16_cpu or not all(have[kernel] for kernel in kernels):
        needs = " and ".join(KERNEL_NEEDS[kernel] for kernel in kernels)
        raise ValueError(f"matmul {choice!r} needs a bfloat16 model on a CPU with {needs}")
    return choice


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        device: str,
        max_model_len: int | None,
        seed: int,
        matmul: str = "auto",
    ) -> None:
        self.model_dir = model_dir
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        config = ModelConfig(model_dir)
        if max_model_len is not None and max_model_len > config.max_len:
            raise ValueError(
                f"max_model_len {max_model_len} is over the model's {config.max_len} positions"
            )
        self.max_model_len = max_model_len or config.max_len
        self.model = LlamaModel(
            model_dir,
            config,
            self.dtype,
            self.device,
            self.max_model_len,
            projection_kernel(matmul, self.dtype, self.device),
        )
        # see `compile_decode`: the loaded package, its load in the background, whether it failed
        self.compiled: CompiledDecode | None = None
        self.compiling: PackageLoad[CompiledDecode] | None = None
        self.compile_failed = False
        self.vocab_size = config.vocab_size
        self.eos_token_ids = config.eos_token_ids
        self.guided = None
        if (model_dir / "tokenizer.json").is_file():
            self.guided = GuidedDecoding(model_dir, self.vocab_size, self.eos_token_ids)
        self.sampler = Sampler(seed, self.device, self.guided)
        self.cache: torch.Tensor | None = None
        self.cache_buffer: memoryview | None = None  # host memory peers move blocks in
        self.mirror: torch.Tensor | None = None  # over cache_buffer, when the cache is not
        self.block_size = 0
        self.num_blocks = 0

    @classmethod
    def create(
        cls,
        model_dir: Path,
        config: EngineConfig,
        cache_buffer: Callable[[int], memoryview] | None = None,
        host_mirror: bool = False,
    ) -> ModelRunner:
        """The runner of an engine config, its KV cache allocated: see `allocate_cache`."""
        retain_freed_memory()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        runner = cls(
            model_dir,
            config.dtype,
            config.device,
            config.max_model_len,
            config.seed,
            config.matmul,
        )
        per_block = runner.model.kv_bytes_per_block(config.block_size)
        num_blocks = config.num_kv_blocks or int(config.kv_cache_gib * 2**30 // per_block)
        if num_blocks < 1:
            raise ValueError("kv_cache_gib is too small for one block")
        runner.allocate_cache(num_blocks, config.block_size, cache_buffer, host_mirror)
        runner.compile_decode(config)
        return runner

    def compile_decode(self, config: EngineConfig) -> None:
        """Run single decodes compiled (`EngineConfig.compile`, compiled_decode.py) from this
        machine's package of the model (decode_package.py).
        - "single-decode": the package is loaded now, built first where there is none (minutes);
          a package that cannot be built, or that does not fit in memory, refuses the engine.
        - "auto": on a CPU; found or built, then loaded, on a thread (`compiling`); steps run
          eagerly until the first step after that, and for good if it fails (a warning says why).
        """
        mode = config.compile
        if mode == "none" or (mode == "auto" and self.device.type != "cpu"):
            return
        spec = PackageSpec.of_engine(self.model_dir, config)
        if mode == "auto":
            self.compiling = PackageLoad(spec, functools.partial(CompiledDecode, self.model))
            return
        try:
            path = built_package(spec)
            self.compiled = load_fitting(path, functools.partial(CompiledDecode, self.model))
        except (BuildFailed, TooLargeToLoad, LoadFailed, TimeoutError) as e:
            raise ValueError(str(e)) from None

    def _take_compiled_decode(self) -> None:
        """Run single decodes compiled from now on, once the background load has ended."""
        assert self.compiling is not None
        try:
            self.compiled = self.compiling.future.result()
            log.info("single decodes run compiled from now on (%s)", self.compiled.path)
        except Exception as e:  # see `PackageLoad`
            log.warning("single decodes stay eager: %s", e)
            self.compile_failed = True
        self.compiling = None

    @property
    def compiled_decode(self) -> str:
        """Where single decodes stand (`compile_decode`; any thread may ask): "on" (the next one
        runs compiled), "loading" (their package is built or loaded in the background),
        "failed" (they stay eager: the log says why) or "off"."""
        compiling = self.compiling  # (read once: the step thread clears it once taken)
        if compiling is not None and not compiling.future.done():
            return "loading"
        if self.compiled is not None:
            return "on"
        if compiling is not None:  # done: the next step takes it
            return "failed" if compiling.future.exception() is not None else "on"
        return "failed" if self.compile_failed else "off"

    def close(self) -> None:
        """Stop a package's build or load under way."""
        if self.compiling is not None:
            self.compiling.stop()

    def allocate_cache(
        self,
        num_blocks: int,
        block_size: int,
        cache_buffer: Callable[[int], memoryview] | None = None,
        host_mirror: bool = False,
    ) -> None:
        """With `cache_buffer(nbytes)` (shared memory, say), the blocks are in that host buffer
        for peers to move: the cache itself on the CPU; else (on a GPU, or with `host_mirror`)
        a mirror of the cache, which `stage_out` and `stage_in` copy blocks to and from."""
        self.cache = None
        c = self.model.config
        shape = (num_blocks, c.num_layers, 2, block_size, c.num_kv_heads, c.head_dim)
        on_host = None
        if cache_buffer is not None:
            buffer = cache_buffer(num_blocks * self.model.kv_bytes_per_block(block_size))
            on_host = torch.frombuffer(buffer, dtype=torch.uint8).view(self.dtype).view(shape)
            self.cache_buffer = buffer
        if on_host is not None and self.device.type == "cpu" and not host_mirror:
            self.cache = on_host
        else:
            self.cache = self.model.allocate_cache(num_blocks, block_size)
            self.mirror = on_host
        self.block_size = block_size
        self.num_blocks = num_blocks

    def stage_out(self, block_ids: list[int], layers: tuple[int, int] | None = None) -> None:
        """Copy blocks of the cache (layers [first, end) of each, if given) to its host mirror
        (before a peer moves them)."""
        if self.mirror is not None and block_ids:
            assert self.cache is not None
            self._copy_blocks(self.mirror, self.cache, block_ids, layers)

    def stage_in(self, block_ids: list[int], layers: tuple[int, int] | None = None) -> None:
        """Copy blocks of the host mirror (layers [first, end) of each, if given) into the
        cache (after a peer moved them there)."""
        if self.mirror is not None and block_ids:
            assert self.cache is not None
            self._copy_blocks(self.cache, self.mirror, block_ids, layers)

    def _copy_blocks(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        block_ids: list[int],
        layers: tuple[int, int] | None,
    ) -> None:
        """- One copy per run of consecutive blocks (a contiguous piece of each tensor), or per
          block when only some layers go.
        - Between a GPU and a pinned mirror the copies are asynchronous (DMA), and done when
          this returns."""
        part = slice(*layers) if layers else slice(None)
        runs = block_runs(block_ids) if layers is None else [(b, 1) for b in block_ids]
        for first, count in runs:
            dst[first : first + count, part].copy_(
                src[first : first + count, part], non_blocking=True
            )
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def kv_layout(self) -> str:
        """The cache's dtype and block shape: caches exchange blocks only when equal."""
        c = self.model.config
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}:{c.num_layers}x2x{self.block_size}x{c.num_kv_heads}x{c.head_dim}"

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the given blocks: [n, layers, 2, block_size, kv_heads, head_dim]. Each
        block is one contiguous piece of the cache (all its layers), so n blocks are n pieces."""
        assert self.cache is not None
        return self.cache[torch.tensor(block_ids, dtype=torch.long, device=self.device)]

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write blocks read from another cache of the same layout (the KV of a prefill)."""
        assert self.cache is not None
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.cache.index_copy_(0, index, data.to(device=self.device, dtype=self.cache.dtype))

    def _rows(self, block_table: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Cache rows of layer 0's K for the given positions of one sequence."""
        table = torch.tensor(block_table, dtype=torch.long, device=self.device)
        stride = self.model.config.num_layers * 2 * self.block_size
        return table[positions // self.block_size] * stride + positions % self.block_size

    def _blocks(self, tables: list[list[int]], length: int) -> torch.Tensor:
        """[N, ceil(length / block size)]: the blocks of each block table that hold its first
        `length` positions (block 0 past a shorter table's end)."""
        width = -(-length // self.block_size)
        return torch.tensor(
            [table[:width] + [0] * (width - len(table)) for table in tables],
            dtype=torch.long,
            device=self.device,
        )

    def build(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[StepBatch, list[ScheduledSeq], list[PromptRows]]:
        """The step's tensors; the scheduled sequences that sample, in the order their logits
        come; then the prompt positions whose logits follow theirs (`prompt_logprobs`)."""
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        for s in scheduled:
            (decodes if _runs_as_decode(s) else prefills).append(s)
        ordered = decodes + prefills
        token_ids: list[int] = []
        positions: list[int] = []
        for s in ordered:
            start = s.seq.num_computed_tokens
            token_ids += s.seq.token_ids[start : start + s.num_tokens]
            positions += range(start, start + s.num_tokens)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        stride = self.model.config.num_layers * 2 * self.block_size
        write_rows = torch.empty_like(pos)
        decode_blocks = decode_mask = None
        decode_len = 0
        if decodes:
            lens = [s.seq.num_computed_tokens + 1 for s in decodes]  # host ints: no device sync
            decode_len = max(lens)
            decode_blocks = self._blocks([s.seq.block_table for s in decodes], decode_len)
            write_rows[: len(decodes)] = torch.tensor(
                [
                    s.seq.block_table[(n - 1) // self.block_size] * stride
                    + (n - 1) % self.block_size
                    for s, n in zip(decodes, lens, strict=True)
                ],
                dtype=torch.long,
                device=self.device,
            )
            if min(lens) != decode_len:  # equal lengths attend to every row: no mask
                lengths = torch.tensor(lens, device=self.device)
                pad = torch.arange(decode_len, device=self.device)[None, :] >= lengths[:, None]
                decode_mask = torch.zeros(
                    pad.shape, dtype=self.dtype, device=self.device
                ).masked_fill_(pad, float("-inf"))[:, None, None, :]
        spans = []
        prompt_rows: list[PromptRows] = []
        prompt_index: list[int] = []
        flat = len(decodes)
        for s in prefills:
            end = flat + s.num_tokens
            computed = s.seq.num_computed_tokens
            context_len = computed + s.num_tokens
            if rows := s.seq.unrecorded_prompt_rows(s.num_tokens):
                prompt_rows.append(PromptRows(s.seq, rows.start, len(rows)))
                prompt_index += range(flat + rows.start - computed, flat + rows.stop - computed)
            chunk = torch.arange(computed, context_len, device=self.device)
            write_rows[flat:end] = self._rows(s.seq.block_table, chunk)
            # With a prefix in the cache, the chunk attends to it too.
            blocks = self._blocks([s.seq.block_table], context_len) if computed else None
            spans.append(PrefillSpan(flat, end, context_len, blocks))
            flat = end
        sampling = [i for i, s in enumerate(ordered) if s.samples]
        ends = []
        flat = 0
        for s in ordered:
            flat += s.num_tokens
            ends.append(flat - 1)
        batch = StepBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions=pos,
            write_rows=write_rows,
            num_decodes=len(decodes),
            decode_blocks=decode_blocks,
            decode_len=decode_len,
            decode_mask=decode_mask,
            prefills=spans,
            logits_index=torch.tensor(
                [ends[i] for i in sampling] + prompt_index, dtype=torch.long, device=self.device
            ),
        )
        return batch, [ordered[i] for i in sampling], prompt_rows

    def _layer_calls(self, scheduled: list[ScheduledSeq]) -> Callable[[int], None] | None:
        """The forward pass's per-layer call: tells each sink of the step's prompt chunks."""
        chunks: list[tuple[KvSink, PromptChunk]] = []
        for s in scheduled:
            seq = s.seq
            if seq.kv_sink is None or seq.num_computed_tokens >= seq.num_prompt_tokens:
                continue
            start = seq.num_computed_tokens
            end = min(start + s.num_tokens, seq.num_prompt_tokens)
            first, last = start // self.block_size, (end - 1) // self.block_size
            blocks = seq.block_table[first : last + 1]
            chunks.append((seq.kv_sink, PromptChunk(start, end, first, blocks)))
        if not chunks:
            return None

        def on_layer(layer: int) -> None:
            for sink, chunk in chunks:
                sink.layer_written(chunk, layer)

        return on_layer

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        """Run the step; the sampled token of each sequence that samples, by request id."""
        assert self.cache is not None, "allocate_cache first"
        if not output.scheduled:
            return {}
        if self.compiling is not None and self.compiling.future.done():
            self._take_compiled_decode()
        batch, sampling, prompt_rows = self.build(output.scheduled)
        on_layer = self._layer_calls(output.scheduled)
        if self.compiled is not None and on_layer is None and self.compiled.takes(batch):
            logits = self.compiled(batch, self.cache)
        else:
            logits = self.model.forward(batch, self.cache, on_layer)
        if prompt_rows:
            self.sampler.record_prompt_logprobs(logits[len(sampling) :], prompt_rows)
            logits = logits[: len(sampling)]
        if not sampling:
            return {}
        seqs = [s.seq for s in sampling]
        tokens = self.sampler(logits, seqs)
        return {seq.request_id: token for seq, token in zip(seqs, tokens, strict=True)}


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive ids, in order: [3, 4, 5, 9] -> [(3, 3), (9, 1)]."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def _runs_as_decode(s: ScheduledSeq) -> bool:
    """Whether `s` runs in the step's decode rows: one token, whose logits no prompt logprob
    reads (a one-token chunk of a prompt whose logprobs are asked for runs as a prefill)."""
    seq = s.seq
    reads_prompt = seq.computes_whole_prompt and seq.num_computed_tokens < seq.num_prompt_tokens - 1
    return s.num_tokens == 1 and not reads_prompt
