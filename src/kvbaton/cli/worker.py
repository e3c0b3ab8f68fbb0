"""`kvbaton worker`: one worker process (an LLM worker with the built-in engine, vLLM's, the
mocker or the fixed stand-in, or an echo worker of the bare runtime)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvbaton.engine.config import COMPILES, DTYPES, MATMULS, MOCKER_DEFAULTS, EngineConfig
from kvbaton.kv_tiers.tiers import DEFAULT_DISK_BYTES
from kvbaton.llm.model_files import resolve_model, served_name
from kvbaton.runtime import DistributedRuntime

if TYPE_CHECKING:  # the worker's modules are imported when it starts (none for echo)
    from kvbaton.disagg.decode_side import DecodeSide
    from kvbaton.disagg.engine_prefill import EnginePrefillSide
    from kvbaton.disagg.prefill_side import PrefillSide
    from kvbaton.kv_tiers import TierSettings
    from kvbaton.kv_transfer import KvPool
    from kvbaton.workers.kv_publisher import KvEventPublisher
    from kvbaton.workers.llm_worker import ServingEngine


async def run_worker(args: argparse.Namespace, runtime: DistributedRuntime) -> int:
    """Serve until the runtime shuts down (0), or the engine fails (1: the worker stopped)."""
    if args.engine == "echo":
        from kvbaton.workers.echo import EchoWorker

        await EchoWorker(runtime, args.namespace, args.component or "backend").serve()
        return 0
    from kvbaton.kv_transfer import KvPool
    from kvbaton.workers.llm_worker import LLMWorker

    check_engine_flags(args)
    component = args.component or ("prefill" if args.role == "prefill" else "backend")
    # A prefill or decode worker's pool lives in shared memory, for peers on this host; on a
    # GPU it is the cache's host mirror, pinned for the GPU's copies.
    pool = KvPool(
        shared=args.role != "agg" and args.kv_transfer != "tcp",
        pin=args.device.startswith("cuda"),
    )
    try:
        engine, publisher = await _engine(args, pool, runtime.settings.host)
        try:
            worker = LLMWorker(
                runtime,
                engine,
                served_name=args.served_model_name or served_name(args.model),
                namespace=args.namespace,
                component=component,
                kv_events=publisher,
                role=args.role,
                side=await _side(args, runtime, engine, pool, component),
            )
        except BaseException:  # stopped, or no side: the engine (vLLM's processes) ends too
            await engine.shutdown()
            raise
        failure = await worker.serve()  # shuts the engine down
    finally:
        pool.close()  # also when the engine or the agent fails to start
    return 0 if failure is None else 1


async def _engine(
    args: argparse.Namespace, pool: KvPool, host: str
) -> tuple[ServingEngine, KvEventPublisher | None]:
    """The engine the flags ask for, and the publisher of its KV events (if it has any).
    `host`: where this worker serves (vLLM's KV connector listens there too)."""
    from kvbaton.workers.kv_publisher import KvEventPublisher

    values = {n: getattr(args, n) for n in ENGINE_FLAGS if getattr(args, n) is not None}
    if args.engine == "fixed":
        from kvbaton.workers.fixed_engine import FixedTokensEngine

        return FixedTokensEngine(args.model, [int(t) for t in args.fixed_tokens.split(",")]), None
    publisher = KvEventPublisher()
    if args.engine == "vllm":
        from kvbaton.engine.vllm_engine import Disaggregated, VllmEngine

        if args.cpu_cores:  # vLLM's processes inherit it
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_cores
        disaggregated = None
        if args.role != "agg":
            disaggregated = Disaggregated.on(args.role, host, args.kv_hold_timeout)
        vllm = await VllmEngine.create(
            args.model, values, args.vllm_args, publisher.on_event, disaggregated
        )
        return vllm, publisher
    if args.engine == "mocker":
        from kvbaton.mocker import MockerTiming, create_mocker_engine
        from kvbaton.mocker.runner import mocker_config
        from kvbaton.mocker.timing import parse_coefficients

        default = MockerTiming()
        timing = MockerTiming(
            prefill=parse_coefficients(args.mocker_prefill)
            if args.mocker_prefill
            else default.prefill,
            decode=parse_coefficients(args.mocker_decode) if args.mocker_decode else default.decode,
            speedup_ratio=args.speedup_ratio or 1.0,
        )
        config = mocker_config(**values)
        engine = await create_mocker_engine(config, timing, publisher.on_event, tier_settings(args))
        return engine, publisher
    from kvbaton.engine import AsyncEngine, EngineConfig

    values["compile"] = worker_compile(args.role, args.compile)
    config = EngineConfig(**values)
    tiers = tier_settings(args)
    # Off the CPU the blocks peers move (and tiers copy) are a host mirror of the cache: only
    # for roles that disaggregate, or with tiers (on the CPU the cache itself lives in the
    # pool's buffer).
    mirror = not config.device.startswith("cpu")
    cache_buffer = pool.allocate if args.role != "agg" or not mirror or tiers.enabled else None
    kv_tier = tiers.for_model(resolve_model(config.model)) if tiers.enabled else None
    engine = await AsyncEngine.create(config, publisher.on_event, cache_buffer, kv_tier)
    if kv_tier is not None:
        from prometheus_client import REGISTRY

        from kvbaton.workers.tier_metrics import TierCollector

        REGISTRY.register(TierCollector(lambda: engine.stats().kv_tiers))
    return engine, publisher


def tier_settings(args: argparse.Namespace) -> TierSettings:
    from kvbaton.kv_tiers import TierSettings

    disk_dir = getattr(args, "kv_disk_dir", None)
    disk_gib = getattr(args, "kv_disk_gib", None)
    return TierSettings(
        host_bytes=int((getattr(args, "kv_offload_gib", None) or 0) * 2**30),
        disk_dir=Path(disk_dir).expanduser() if disk_dir else None,
        disk_bytes=int(disk_gib * 2**30) if disk_gib is not None else DEFAULT_DISK_BYTES,
    )


async def _side(
    args: argparse.Namespace,
    runtime: DistributedRuntime,
    engine: ServingEngine,
    pool: KvPool,
    component: str,
) -> PrefillSide | EnginePrefillSide | DecodeSide | None:
    """The worker's side of disaggregation, for an engine with a KV cache (the built-in one,
    the mocker)."""
    from kvbaton.disagg.decode_side import DecodeSide
    from kvbaton.disagg.engine_prefill import EnginePrefillSide
    from kvbaton.disagg.prefill_side import PrefillSide
    from kvbaton.engine.async_engine import AsyncEngine
    from kvbaton.engine.vllm_engine import VllmEngine
    from kvbaton.kv_transfer import KvTransferAgent

    if isinstance(engine, VllmEngine):  # it moves its KV itself
        if args.role != "prefill":
            return None
        named = f"{args.namespace}.{component}"
        return EnginePrefillSide(runtime, engine, named, engine.block_size)
    if not isinstance(engine, AsyncEngine):
        if args.role != "agg":
            raise ValueError(f"--role {args.role} needs --engine torch, mocker or vllm")
        return None
    view = engine.engine.kv_cache()
    pool.attach(view.buffer, view.layout, view.num_blocks, view.block_bytes, view.num_layers)
    agent = KvTransferAgent(pool, args.kv_transfer, args.kv_transfer_timeout)
    if args.role != "agg":  # peers reach its pool (an agg worker only reads theirs)
        agent.start(runtime.settings.host, f"kvbaton-{await runtime.ensure_instance_id():x}")
    side = (runtime, engine, agent, view, f"{args.namespace}.{component}", engine.block_size)
    if args.role != "prefill":
        from prometheus_client import REGISTRY

        from kvbaton.workers.handoff_metrics import HandoffCollector

        decode = DecodeSide(*side)
        REGISTRY.register(HandoffCollector(decode))
        return decode
    return PrefillSide(
        *side,
        hold_timeout_s=args.kv_hold_timeout,
        push=args.kv_push,
        max_pushes=engine.engine.config.max_num_seqs,
    )


def check_engine_flags(args: argparse.Namespace) -> None:
    given = [f for f in MOCKER_FLAGS if getattr(args, f) is not None]
    if given and args.engine != "mocker":
        raise ValueError(f"--{given[0].replace('_', '-')} is for --engine mocker")
    if getattr(args, "vllm_args", None) and args.engine != "vllm":
        raise ValueError("arguments after `--` are vLLM's, for --engine vllm")
    if getattr(args, "cpu_cores", None) and args.engine != "vllm":
        raise ValueError("--cpu-cores is for --engine vllm")
    tiers = [f for f in TIER_FLAGS if getattr(args, f, None) is not None]
    if tiers and args.engine not in ("torch", "mocker"):
        raise ValueError(f"--{tiers[0].replace('_', '-')} is for --engine torch or mocker")
    if getattr(args, "kv_disk_gib", None) is not None and not getattr(args, "kv_disk_dir", None):
        raise ValueError("--kv-disk-gib needs --kv-disk-dir")
    for flag in ("kv_offload_gib", "kv_disk_gib"):
        if (getattr(args, flag, None) or 0) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must not be negative")
    if args.engine == "vllm":
        if getattr(args, "transfer_order", "prefill-first") != "prefill-first":
            raise ValueError("--engine vllm disaggregates in the prefill-first order only")
        from kvbaton.engine.vllm_engine import vllm_missing

        if (missing := vllm_missing()) is not None:
            raise ValueError(missing)


def worker_compile(role: str, given: str | None) -> str:
    """The kvbaton engine's compile mode: `--compile`, else `$KVBATON_COMPILE`, else "auto"; a
    prefill worker's "auto" is "none" (it decodes no sequence alone)."""
    mode = given or os.environ.get("KVBATON_COMPILE", "auto")
    return "none" if role == "prefill" and mode == "auto" else mode


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """Engine flags, shared by `worker` and `serve` (which passes them on to its workers)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default="smollm2", help="a pulled model or a directory")
    group.add_argument("--served-model-name", help="the name clients ask for")
    group.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    group.add_argument("--device", default="cpu")
    engine, mocked = EngineConfig(), MOCKER_DEFAULTS
    group.add_argument(
        "--block-size",
        type=int,
        help=f"tokens per KV block ({engine.block_size}; mocker {mocked['block_size']})",
    )
    group.add_argument(
        "--kv-cache-gib", type=float, help=f"KV cache size in GiB (default {engine.kv_cache_gib})"
    )
    group.add_argument(
        "--num-kv-blocks",
        type=int,
        help=f"(default: as many as fit; mocker {mocked['num_kv_blocks']})",
    )
    group.add_argument(
        "--max-num-seqs",
        type=int,
        help=f"(default {engine.max_num_seqs}; mocker {mocked['max_num_seqs']})",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help=f"(default {engine.max_num_batched_tokens}; "
        f"mocker {mocked['max_num_batched_tokens']})",
    )
    group.add_argument("--max-model-len", type=int)
    group.add_argument("--num-threads", type=int, help="torch threads (default: cores/workers)")
    group.add_argument(
        "--matmul",
        choices=MATMULS,
        help="a bfloat16 model's projection kernels on a CPU (default auto: oneDNN's alone "
        "with AMX, else oneDNN's and FBGEMM's, those the CPU has; one alone keeps one copy of "
        "the weights)",
    )
    group.add_argument(
        "--compile",
        choices=COMPILES,
        help="a step that decodes one sequence alone runs compiled, from a package built once "
        "per model and machine (minutes on a few cores; docs/architecture.md). auto (the "
        "default, or $KVBATON_COMPILE): on a CPU with a C++ compiler, steps run eagerly while "
        "the package builds in the background; single-decode: the package is built before "
        "serving; none: eagerly. A prefill worker's auto is none",
    )
    group.add_argument("--fixed-tokens", default="1,2,3", help="the fixed engine's token ids")
    disagg = parser.add_argument_group("disaggregation")
    disagg.add_argument(
        "--kv-transfer",
        choices=["auto", "nixl", "shm", "tcp"],
        default="auto",
        help="how KV blocks move between workers (auto: shm on one host, else nixl where both "
        "have it, else tcp)",
    )
    disagg.add_argument(
        "--kv-transfer-timeout", type=float, default=30.0, help="seconds a transfer may take"
    )
    disagg.add_argument(
        "--kv-hold-timeout",
        type=float,
        default=30.0,
        help="seconds a prefill worker holds a request's KV for its decode worker",
    )
    disagg.add_argument(
        "--kv-push",
        choices=["layers", "blocks"],
        default="layers",
        help="decode-first: a prefill worker writes the prompt's KV into the decode worker's "
        "blocks layer by layer as it computes them (layers), or whole blocks once the prompt is "
        "computed (blocks)",
    )
    tiers = parser.add_argument_group("KV tiers below the pool (--engine torch or mocker)")
    tiers.add_argument(
        "--kv-offload-gib",
        type=float,
        help="host memory for blocks evicted from the KV pool (default 0: none)",
    )
    tiers.add_argument(
        "--kv-disk-dir",
        help="a directory for blocks evicted from the KV pool, shared by the workers of a host",
    )
    tiers.add_argument(
        "--kv-disk-gib",
        type=float,
        help=f"the disk tier's size (default {DEFAULT_DISK_BYTES / 2**30:g})",
    )
    mocker = parser.add_argument_group("mocker (timing defaults: Dynamo's mocker)")
    mocker.add_argument("--speedup-ratio", type=float, help="divide step times by it (default 1)")
    mocker.add_argument("--mocker-prefill", metavar="A,B,C", help="prefill ms = A*t^2 + B*t + C")
    mocker.add_argument(
        "--mocker-decode", metavar="A,B,C", help="decode ms = max(1, A*u^2 + B*u + C)"
    )


ENGINE_FLAGS = (
    "model",
    "dtype",
    "device",
    "block_size",
    "kv_cache_gib",
    "num_kv_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "num_threads",
    "matmul",
    "compile",
)
MOCKER_FLAGS = ("speedup_ratio", "mocker_prefill", "mocker_decode")
TIER_FLAGS = ("kv_offload_gib", "kv_disk_dir", "kv_disk_gib")
DISAGG_FLAGS = ("kv_transfer", "kv_transfer_timeout", "kv_hold_timeout", "kv_push")
# What `serve` passes on to its workers.
WORKER_FLAGS = (
    *ENGINE_FLAGS,
    *MOCKER_FLAGS,
    *DISAGG_FLAGS,
    *TIER_FLAGS,
    "served_model_name",
    "fixed_tokens",
)
