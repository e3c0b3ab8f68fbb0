"""The frontend's serving flags (migration, timeouts, API key, reasoning and tool-call
parsers), shared by
`frontend` and `serve` (which passes them on to its frontend; the API key through the
environment, not its command line, where `ps` would show it)."""

from __future__ import annotations

import argparse
import os

from kvbaton.frontend.reasoning import REASONING_FORMATS, ReasoningFormat
from kvbaton.frontend.response_store import DEFAULT_MAX_BYTES
from kvbaton.frontend.settings import BusyThresholds, CanarySettings, MigrationSettings
from kvbaton.frontend.tool_calls import TOOL_CALL_FORMATS, ToolCallFormat

FRONTEND_FLAGS = (
    "migration_limit",
    "first_output_timeout",
    "stream_idle_timeout",
    "worker_wait_timeout",
    "busy_kv_usage",
    "busy_prefill_tokens",
    "canary_period",
    "canary_timeout",
    "reasoning_parser",
    "tool_call_parser",
    "responses_store_mib",
)
API_KEY_ENV = "KVBATON_API_KEY"


def add_frontend_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("faults (the frontend)")
    defaults = MigrationSettings()
    group.add_argument(
        "--migration-limit",
        type=int,
        default=defaults.limit,
        help="times a request whose worker is lost mid-stream is sent on to another worker "
        f"(0: never; default {defaults.limit})",
    )
    group.add_argument(
        "--first-output-timeout",
        type=float,
        default=defaults.first_output_s,
        metavar="SECONDS",
        help="a worker that sends nothing this long after taking a request is given up on: "
        f"migrate, or 504 (default {defaults.first_output_s:g})",
    )
    group.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=defaults.idle_s,
        metavar="SECONDS",
        help=f"the same, between two outputs of a stream (default {defaults.idle_s:g})",
    )
    group.add_argument(
        "--worker-wait-timeout",
        type=float,
        default=defaults.worker_wait_s,
        metavar="SECONDS",
        help="when a model's last worker goes (a crash that `serve` restarts), its requests wait "
        f"this long for one to come back before a 503 (0: at once; default "
        f"{defaults.worker_wait_s:g})",
    )
    busy = BusyThresholds()
    group.add_argument(
        "--busy-kv-usage",
        type=float,
        default=busy.kv_usage,
        metavar="FRACTION",
        help="a worker with this share of its KV blocks in use is busy; when every worker is, "
        f"requests get 503 + Retry-After (0: not checked; default {busy.kv_usage}; changed at "
        "run time by POST /busy_threshold)",
    )
    group.add_argument(
        "--busy-prefill-tokens",
        type=int,
        default=busy.prefill_tokens,
        metavar="TOKENS",
        help="the same, for prompt tokens waiting for prefill at a worker "
        f"(0: not checked; default {busy.prefill_tokens})",
    )
    canary = CanarySettings()
    group.add_argument(
        "--canary-period",
        type=float,
        default=canary.period_s,
        metavar="SECONDS",
        help="a worker sent nothing this long gets a 1-token canary request; one that fails it "
        f"is not routed to until one passes (0: no canaries; default {canary.period_s:g})",
    )
    group.add_argument(
        "--canary-timeout",
        type=float,
        default=canary.timeout_s,
        metavar="SECONDS",
        help=f"a canary with no token by then failed (default {canary.timeout_s:g})",
    )
    group.add_argument(
        "--api-key",
        help="ask every request but /health, /live and /metrics for `Authorization: Bearer KEY` "
        "(or `x-api-key: KEY`, as Anthropic's clients send it) "
        f"(default: ${API_KEY_ENV}, else no key)",
    )
    parser.add_argument_group("the OpenAI API (the frontend)").add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_FORMATS),
        help="split chat answers' <think> reasoning into `reasoning_content`, out of `content` "
        "(deepseek-r1: the answer may start inside the reasoning, without <think>; qwen3: it "
        "opens with <think>, else it is all content; default: no split)",
    )
    parser.add_argument_group("the OpenAI API (the frontend)").add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_FORMATS),
        help="the format models write tool calls in (hermes: <tool_call>{...}</tool_call>; "
        'llama3_json: {"name": ..., "parameters": ...}; mistral: [TOOL_CALLS][...]; '
        "default: the one the chat template writes, else hermes)",
    )
    parser.add_argument_group("the OpenAI API (the frontend)").add_argument(
        "--responses-store-mib",
        type=float,
        default=DEFAULT_MAX_BYTES / (1 << 20),
        metavar="MIB",
        help="the Responses API's responses each frontend keeps in memory, for "
        "previous_response_id and GET /v1/responses/{id} (the least recently used forgotten "
        f"first; 0: keep none; default {DEFAULT_MAX_BYTES >> 20})",
    )


def busy_thresholds(args: argparse.Namespace) -> BusyThresholds:
    return BusyThresholds(
        kv_usage=args.busy_kv_usage or None, prefill_tokens=args.busy_prefill_tokens or None
    )


def canary_settings(args: argparse.Namespace) -> CanarySettings:
    return CanarySettings(period_s=args.canary_period, timeout_s=args.canary_timeout)


def api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def migration_settings(args: argparse.Namespace) -> MigrationSettings:
    return MigrationSettings(
        limit=args.migration_limit,
        first_output_s=args.first_output_timeout,
        idle_s=args.stream_idle_timeout,
        worker_wait_s=args.worker_wait_timeout,
    )


def responses_store_bytes(args: argparse.Namespace) -> int:
    return int(args.responses_store_mib * (1 << 20))


def tool_format(args: argparse.Namespace) -> ToolCallFormat | None:
    return TOOL_CALL_FORMATS[args.tool_call_parser] if args.tool_call_parser else None


def reasoning(args: argparse.Namespace) -> ReasoningFormat | None:
    return REASONING_FORMATS[args.reasoning_parser] if args.reasoning_parser else None
