"""The engine's one frozen config, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
MATMULS = ("auto", "native", "fbgemm-fp16", "onednn-bf16", "fbgemm-fp16+onednn-bf16")
COMPILES = ("none", "single-decode", "auto")
BUILD_WAIT_S = 3600.0  # a compiled decode's build: minutes on a few cores, more for more weights
BUILD_PROGRESS_S = 30.0  # how often a compiled decode's build, or a wait for it, is reported
# The mocker's engine settings where they differ from EngineConfig's: Dynamo's mocker's, so that
# results compare with it (here, not in the mocker, so that the CLI reads them without torch).
MOCKER_DEFAULTS = {
    "block_size": 64,
    "num_kv_blocks": 16384,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
}


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"  # a pulled model's name or a model directory
    dtype: str = "bfloat16"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: as many as kv_cache_gib holds
    kv_cache_gib: float = 1.0
    max_num_seqs: int = 64
    # A step's tokens. 1,024 rather than vLLM's 2,048: a burst of prompts gets its first tokens
    # in smaller groups and running streams wait half as long per prefill step (on a 2-core CPU,
    # TTFT p50 at concurrency 16 about halved at the same tokens/s: docs/benchmarks.md).
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch threads on CPU; None: torch's default
    seed: int = 0  # for requests without their own seed
    matmul: str = "auto"  # projections' kernel: "auto" or one of model.KERNELS (see model.py)
    # single decodes compiled: "single-decode", "auto" (built in the background where it can
    # be) or "none" (ModelRunner.compile_decode)
    compile: str = "none"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, not {self.dtype!r}")
        if self.device.startswith("cpu") and self.dtype == "float16":
            raise ValueError("float16 is for CUDA; use bfloat16 or float32 on CPU")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if self.matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {MATMULS}, not {self.matmul!r}")
        if self.compile not in COMPILES:
            raise ValueError(f"compile must be one of {COMPILES}, not {self.compile!r}")
        if self.compile == "single-decode" and not self.device.startswith("cpu"):
            raise ValueError(f"compile {self.compile!r} runs on a CPU only")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be positive")
