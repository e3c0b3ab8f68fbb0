"""`kvbaton worker`: one worker process (an LLM worker with the built-in engine or the fixed
stand-in, or an echo worker of the bare runtime)."""

from __future__ import annotations

import argparse

from kvbaton.llm.model_files import served_name
from kvbaton.runtime import DistributedRuntime


async def run_worker(args: argparse.Namespace, runtime: DistributedRuntime) -> None:
    if args.engine == "echo":
        from kvbaton.workers.echo import EchoWorker

        await EchoWorker(runtime, args.namespace, args.component).serve()
        return
    from kvbaton.workers.llm_worker import LLMWorker, ServingEngine

    engine: ServingEngine
    if args.engine == "fixed":
        from kvbaton.workers.fixed_engine import FixedTokensEngine

        engine = FixedTokensEngine(args.model, [int(t) for t in args.fixed_tokens.split(",")])
    else:
        from kvbaton.engine import AsyncEngine, EngineConfig

        config = EngineConfig(**{name: getattr(args, name) for name in ENGINE_FLAGS})
        engine = await AsyncEngine.create(config)
    worker = LLMWorker(
        runtime,
        engine,
        served_name=args.served_model_name or served_name(args.model),
        namespace=args.namespace,
        component=args.component,
    )
    await worker.serve()


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """Engine flags, shared by `worker` and `serve` (which passes them on to its workers)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default="smollm2", help="a pulled model or a directory")
    group.add_argument("--served-model-name", help="the name clients ask for")
    group.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    group.add_argument("--device", default="cpu")
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--kv-cache-gib", type=float, default=1.0)
    group.add_argument("--num-kv-blocks", type=int)
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-model-len", type=int)
    group.add_argument("--num-threads", type=int, help="torch threads (default: cores/workers)")
    group.add_argument("--fixed-tokens", default="1,2,3", help="the fixed engine's token ids")


ENGINE_FLAGS = (
    "model",
    "dtype",
    "device",
    "block_size",
    "kv_cache_gib",
    "num_kv_blocks",
    "max_num_seqs",
    "max_model_len",
    "num_threads",
)
WORKER_FLAGS = (*ENGINE_FLAGS, "served_model_name", "fixed_tokens")  # what `serve` passes on
