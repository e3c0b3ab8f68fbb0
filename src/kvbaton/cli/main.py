"""`kvbaton serve | worker | status`: thin entry points over a settings object."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from kvbaton import __version__
from kvbaton.runtime import DistributedRuntime, RuntimeSettings

log = logging.getLogger("kvbaton")


def _runtime_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("runtime (flags win over KVBATON_* variables)")
    group.add_argument("--discovery", help="file:///dir (default: a per-user dir) or mem://name")
    group.add_argument("--request-plane", help="tcp (default)")
    group.add_argument("--host", help="address to bind and advertise (default 127.0.0.1)")
    group.add_argument("--port", type=int, help="request-plane port (default: any free port)")
    group.add_argument("--lease-ttl", type=float, help="seconds (default 10)")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )


def runtime_settings(args: argparse.Namespace) -> RuntimeSettings:
    """Flags given on the command line, then KVBATON_* variables, then defaults."""
    names = ("discovery", "request_plane", "host", "port", "lease_ttl")
    overrides = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    return RuntimeSettings(**overrides)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("watchfiles").setLevel(logging.WARNING)


def run_until_signal(
    main: Callable[[], Awaitable[Any]], on_signal: Callable[[], Awaitable[Any]]
) -> None:
    """Run `main`; on SIGINT or SIGTERM run `on_signal` (a graceful stop) and let `main` end."""

    async def runner() -> None:
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Task[Any]] = []

        def handle() -> None:
            if not stopping:
                log.info("stopping (signal received)")
                stopping.append(asyncio.ensure_future(on_signal()))

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, handle)
        await main()
        if stopping:
            await stopping[0]

    try:
        import uvloop

        uvloop.run(runner())
    except ImportError:
        asyncio.run(runner())


def cmd_worker(args: argparse.Namespace) -> int:
    from kvbaton.workers.echo import EchoWorker

    runtime = DistributedRuntime(settings=runtime_settings(args))

    async def main() -> None:
        await EchoWorker(runtime, args.namespace, args.component).serve()

    run_until_signal(main, runtime.shutdown)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from kvbaton.cli.serve import serve

    return serve(args, runtime_settings(args))


def cmd_status(args: argparse.Namespace) -> int:
    from kvbaton.cli.status import status

    return status(runtime_settings(args), args.namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbaton", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvbaton {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a whole deployment on this machine")
    serve.add_argument("--namespace", default="kvbaton")
    serve.add_argument("--workers", type=int, default=1, help="number of worker processes")
    _runtime_flags(serve)
    serve.set_defaults(func=cmd_serve)

    worker = sub.add_parser("worker", help="run one worker process")
    worker.add_argument("--engine", choices=["echo"], default="echo")
    worker.add_argument("--namespace", default="kvbaton")
    worker.add_argument("--component", default="backend")
    _runtime_flags(worker)
    worker.set_defaults(func=cmd_worker)

    status = sub.add_parser("status", help="list the instances discovery knows")
    status.add_argument("--namespace", help="only this namespace")
    _runtime_flags(status)
    status.set_defaults(func=cmd_status)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        code = args.func(args)
    except ValueError as exc:  # bad settings: say what, not a traceback
        print(f"kvbaton: error: {exc}", file=sys.stderr)
        code = 2
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    sys.exit(code)
