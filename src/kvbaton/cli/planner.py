"""`kvbaton planner`: observe a frontend and its workers, and scale the prefill and decode pools
to meet the TTFT and ITL targets (through the `local` or `kubernetes` connector)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvbaton.cli.core_share import vllm_worker_cores
from kvbaton.planner.types import Profile, Targets
from kvbaton.runtime import DistributedRuntime, RuntimeSettings

log = logging.getLogger(__name__)


def add_planner_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--frontend", required=True, help="the frontend's URL, http://host:port")
    parser.add_argument("--namespace", default="kvbaton")
    parser.add_argument("--model", help="plan for this model's traffic only (default: all)")
    parser.add_argument(
        "--profile", required=True, type=Path, help="the workers' curves (`kvbaton profile`)"
    )
    parser.add_argument("--ttft-ms", type=float, required=True, help="the TTFT target")
    parser.add_argument("--itl-ms", type=float, required=True, help="the ITL target")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between decisions")
    parser.add_argument(
        "--predictor",
        default="moving-average",
        help="constant, moving-average, holt or level-shift",
    )
    for role in ("prefill", "decode"):
        parser.add_argument(f"--min-{role}", type=int, default=1)
        parser.add_argument(f"--max-{role}", type=int, default=8)
    parser.add_argument("--max-workers", type=int, help="budget: prefill + decode, at most")
    parser.add_argument("--max-step", type=int, default=2, help="workers per role per interval")
    parser.add_argument(
        "--scale-down-patience",
        type=int,
        default=3,
        help="intervals the load must stay low before a pool shrinks",
    )
    parser.add_argument("--connector", choices=["local", "kubernetes"], default="local")
    parser.add_argument("--dry-run", action="store_true", help="log decisions, change nothing")
    parser.add_argument(
        "--worker-flags",
        default="",
        help='local: flags of every worker it starts, e.g. "--engine mocker --model M" '
        "(--role, --namespace and the runtime flags are added)",
    )
    parser.add_argument(
        "--worker-log-dir",
        type=Path,
        help="local: where each started worker's log goes (default: a new temporary directory, "
        "kept for reading after the planner stops)",
    )
    parser.add_argument("--k8s-namespace", default="default")
    parser.add_argument("--prefill-deployment", default="kvbaton-prefill")
    parser.add_argument("--decode-deployment", default="kvbaton-decode")
    parser.add_argument("--k8s-host", help="the API server's URL (default: KUBECONFIG, in-cluster)")
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="serve the planner's metrics here (0: off)"
    )


def load_profile(path: Path) -> Profile:
    try:
        return Profile.from_json(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read the profile {path}: {exc}") from exc
    except Exception as exc:
        raise ValueError(f"{path} is not a profile written by `kvbaton profile`: {exc}") from exc


def runtime_flags(settings: RuntimeSettings) -> list[str]:
    """The flags that put a worker on the planner's own discovery and planes."""
    return [
        f"--discovery={settings.discovery}",
        f"--request-plane={settings.request_plane}",
        f"--event-plane={settings.event_plane}",
        f"--nats-url={settings.nats_url}",
        f"--lease-ttl={settings.lease_ttl}",
    ]


def connector_options(args: argparse.Namespace, settings: RuntimeSettings) -> dict[str, Any]:
    if args.connector == "kubernetes":
        return {
            "namespace": args.k8s_namespace,
            "deployments": {"prefill": args.prefill_deployment, "decode": args.decode_deployment},
            "host": args.k8s_host,
        }
    flags = shlex.split(args.worker_flags)
    common = [*flags, "--namespace", args.namespace, *runtime_flags(settings)]
    return {
        "worker_args": {role: ["--role", role, *common] for role in ("prefill", "decode")},
        "core_slots": vllm_core_slots(args, flags, os.environ),
        "log_dir": args.worker_log_dir,
    }


def vllm_core_slots(
    args: argparse.Namespace, flags: list[str], environ: Mapping[str, str]
) -> list[str]:
    """The local connector's core slots: for vLLM workers, the cores this process may run on
    split among the most workers the planner may run at once (as `serve` splits them among its
    workers); none where the flags or VLLM_CPU_OMP_THREADS_BIND bind them, or for other engines."""
    worker = argparse.ArgumentParser(add_help=False)
    worker.add_argument("--engine")
    worker.add_argument("--cpu-cores")
    given, _ = worker.parse_known_args(flags)  # what follows `--` is vLLM's, not read
    if given.engine != "vllm" or given.cpu_cores or "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return []
    most = args.max_workers or args.max_prefill + args.max_decode
    return vllm_worker_cores(most, list(os.sched_getaffinity(0))) or []


async def run_planner(args: argparse.Namespace, runtime: DistributedRuntime) -> None:
    from prometheus_client import CollectorRegistry, start_http_server

    from kvbaton.planner.connectors import make_connector
    from kvbaton.planner.observer import Observer
    from kvbaton.planner.planner import Planner, PlannerMetrics, Predictors
    from kvbaton.planner.predictors import make_predictor
    from kvbaton.planner.replicas import ReplicaPlanner, ReplicaPolicy
    from kvbaton.planner.reports import DecisionReports

    policy = ReplicaPolicy(
        min_prefill=args.min_prefill,
        max_prefill=args.max_prefill,
        min_decode=args.min_decode,
        max_decode=args.max_decode,
        max_total=args.max_workers,
        max_step=args.max_step,
        scale_down_patience=args.scale_down_patience,
    )
    replicas = ReplicaPlanner(
        load_profile(args.profile), Targets(ttft_ms=args.ttft_ms, itl_ms=args.itl_ms), policy
    )
    predictors = Predictors(
        *(make_predictor(args.predictor, interval_s=args.interval) for _ in range(3))
    )
    registry = CollectorRegistry()
    if args.metrics_port:
        start_http_server(args.metrics_port, "127.0.0.1", registry)
    connector = make_connector(
        args.connector, dry_run=args.dry_run, **connector_options(args, runtime.settings)
    )
    observer = Observer(runtime, args.frontend, args.namespace, model=args.model)
    planner = Planner(
        observer,
        connector,
        replicas,
        predictors,
        interval_s=args.interval,
        dry_run=args.dry_run,
        metrics=PlannerMetrics(registry),
        reports=DecisionReports(runtime, args.namespace, args.interval),
    )
    try:
        run = asyncio.ensure_future(planner.run())
        stopping = asyncio.ensure_future(runtime.wait_for_shutdown())
        await asyncio.wait({run, stopping}, return_when=asyncio.FIRST_COMPLETED)
        planner.stop()
        stopping.cancel()
        await run
    finally:
        await observer.close()
        await connector.close()
