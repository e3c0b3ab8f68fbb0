"""Routing flags, shared by `frontend` and `serve` (which passes them on to its frontend)."""

from __future__ import annotations

import argparse

from kvbaton.router import DEFAULT_OVERLAP_WEIGHT, ROUTER_MODES, RouterSettings

ROUTER_FLAGS = ("router_mode", "kv_overlap_score_weight", "router_temperature")


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("routing")
    group.add_argument(
        "--router-mode",
        choices=ROUTER_MODES,
        help="default: kv when the workers publish KV events, else least-loaded",
    )
    group.add_argument(
        "--kv-overlap-score-weight",
        type=float,
        default=DEFAULT_OVERLAP_WEIGHT,
        help="kv: blocks to prefill against active blocks (default %(default)g; Dynamo's: 1)",
    )
    group.add_argument(
        "--router-temperature",
        type=float,
        default=0.0,
        help="kv: 0 picks the cheapest worker; above 0 draws by softmax of the costs",
    )
    group.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        help="kv: index the requests routed (expiring after a TTL) instead of KV events",
    )


def router_settings(args: argparse.Namespace) -> RouterSettings:
    return RouterSettings(
        mode=args.router_mode,
        kv_events=args.kv_events,
        overlap_weight=args.kv_overlap_score_weight,
        temperature=args.router_temperature,
    )
