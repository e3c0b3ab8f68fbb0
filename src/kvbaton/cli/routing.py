"""Routing flags, shared by `frontend` and `serve` (which passes them on to its frontend)."""

from __future__ import annotations

import argparse

from kvbaton.router import DEFAULT_OVERLAP_WEIGHT, ROUTER_MODES, RouterSettings
from kvbaton.router.disagg import TRANSFER_ORDERS
from kvbaton.router.indexer import TierCredits

ROUTER_FLAGS = (
    "router_mode",
    "kv_overlap_score_weight",
    "router_temperature",
    "kv_tier_credits",
    "max_local_prefill_tokens",
    "transfer_order",
)


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
        "--kv-tier-credits",
        metavar="HOST,DISK",
        default="0.75,0.25",
        help="kv: a block a worker can load from its host memory or disk tier, as a share of "
        "one in its pool (default %(default)s, Dynamo's)",
    )
    group.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        help="kv: index the requests routed (expiring after a TTL) instead of KV events",
    )
    disagg = parser.add_argument_group("disaggregation (once prefill workers exist)")
    disagg.add_argument(
        "--enforce-disagg",
        action="store_true",
        help="answer 503 rather than run a request whole on a decode worker with no prefill one",
    )
    disagg.add_argument(
        "--transfer-order",
        choices=TRANSFER_ORDERS,
        default="prefill-first",
        help="prefill-first: the decode worker reads the KV; decode-first: the prefill worker "
        "writes it into blocks the decode worker allocated",
    )
    disagg.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=0,
        help="prefill on the decode worker when fewer prompt tokens than this are uncached "
        "there (default 0: never)",
    )


def router_settings(args: argparse.Namespace) -> RouterSettings:
    return RouterSettings(
        mode=args.router_mode,
        kv_events=args.kv_events,
        overlap_weight=args.kv_overlap_score_weight,
        temperature=args.router_temperature,
        tier_credits=parse_tier_credits(args.kv_tier_credits),
        enforce_disagg=args.enforce_disagg,
        max_local_prefill_tokens=args.max_local_prefill_tokens,
        transfer_order=args.transfer_order,
    )


def parse_tier_credits(text: str) -> TierCredits:
    """ "HOST,DISK" -> TierCredits (ValueError if not two numbers with 0 <= DISK <= HOST <= 1)."""
    try:
        host, disk = (float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--kv-tier-credits takes HOST,DISK, not {text!r}") from None
    return TierCredits(host, disk)
