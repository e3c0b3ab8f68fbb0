"""`kvbaton deploy kubernetes`: print the manifests of a deployment (or write one file per
object with --output-dir). Bad input raises ValueError before anything is written."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvbaton.deploy.kubernetes import (
    KubernetesOptions,
    file_name,
    manifests,
    read_profile,
    to_yaml,
)

DEFAULTS = KubernetesOptions()


def add_deploy_flags(parser: argparse.ArgumentParser) -> None:
    targets = parser.add_subparsers(dest="target", required=True)
    kube = targets.add_parser(
        "kubernetes",
        help="Kubernetes manifests (stdout: `... | kubectl apply -f -`)",
        description="Write the Kubernetes objects of a kvbaton deployment, as YAML on stdout "
        "or one file per object in --output-dir.",
    )
    kube.add_argument("--mode", choices=["agg", "disagg"], default=DEFAULTS.mode)
    kube.add_argument("--model", default=DEFAULTS.model, help="the workers' --model")
    kube.add_argument("--workers", type=int, help="agg: worker replicas (default 1)")
    kube.add_argument("--prefill", type=int, help="disagg: prefill replicas (default 1)")
    kube.add_argument("--decode", type=int, help="disagg: decode replicas (default 1)")
    kube.add_argument(
        "--gpus-per-worker",
        type=int,
        default=DEFAULTS.gpus_per_worker,
        help="nvidia.com/gpu per worker pod, and --device cuda (default 0: CPU)",
    )
    kube.add_argument(
        "--worker-flags",
        default="",
        help='more worker flags, as one word: --worker-flags="--dtype float32"',
    )
    kube.add_argument("--image", default=DEFAULTS.image, help="the kvbaton image (Containerfile)")
    kube.add_argument("--name", default=DEFAULTS.name, help="prefix of every object's name")
    kube.add_argument("--k8s-namespace", default=DEFAULTS.k8s_namespace)
    kube.add_argument("--kvbaton-namespace", default=DEFAULTS.kvbaton_namespace)
    kube.add_argument(
        "--with-etcd", action="store_true", help="an etcd for discovery (default: the API server)"
    )
    kube.add_argument("--with-nats", action="store_true", help="a NATS server for KV events")
    planner = kube.add_argument_group("planner (disagg)")
    planner.add_argument("--with-planner", action="store_true", help="a planner that scales")
    planner.add_argument("--planner-profile", metavar="FILE", help="made by `kvbaton profile`")
    planner.add_argument("--ttft-ms", type=float, help="the TTFT target")
    planner.add_argument("--itl-ms", type=float, help="the ITL target")
    for role in ("prefill", "decode"):
        default_min, default_max = (
            (DEFAULTS.min_prefill, DEFAULTS.max_prefill)
            if role == "prefill"
            else (DEFAULTS.min_decode, DEFAULTS.max_decode)
        )
        planner.add_argument(f"--min-{role}", type=int, default=default_min)
        planner.add_argument(f"--max-{role}", type=int, default=default_max)
    kube.add_argument(
        "--output-dir", type=Path, help="write NN-kind-name.yaml files here (new or empty)"
    )


def options_from_args(args: argparse.Namespace) -> KubernetesOptions:
    if args.mode == "agg" and (args.prefill is not None or args.decode is not None):
        raise ValueError("--prefill and --decode are for --mode disagg (agg: --workers)")
    if args.mode == "disagg" and args.workers is not None:
        raise ValueError("--workers is for --mode agg (disagg: --prefill and --decode)")
    profile = read_profile(args.planner_profile) if args.planner_profile is not None else None

    def count(value: int | None) -> int:
        return 1 if value is None else value

    return KubernetesOptions(
        mode=args.mode,
        model=args.model,
        workers=count(args.workers),
        prefill=count(args.prefill),
        decode=count(args.decode),
        gpus_per_worker=args.gpus_per_worker,
        with_planner=args.with_planner,
        planner_profile=profile,
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        min_prefill=args.min_prefill,
        max_prefill=args.max_prefill,
        min_decode=args.min_decode,
        max_decode=args.max_decode,
        with_etcd=args.with_etcd,
        with_nats=args.with_nats,
        image=args.image,
        name=args.name,
        k8s_namespace=args.k8s_namespace,
        kvbaton_namespace=args.kvbaton_namespace,
        worker_flags=args.worker_flags,
    )


def deploy_command(args: argparse.Namespace) -> int:
    objects = manifests(options_from_args(args))
    out: Path | None = args.output_dir
    if out is None:
        print(to_yaml(objects), end="")
        return 0
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--output-dir {out} must be a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    for index, obj in enumerate(objects, start=1):
        (out / file_name(index, obj)).write_text(to_yaml([obj]), encoding="utf-8")
    print(out)  # the last line is the directory
    return 0
