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
from kvbaton.cli.deploy import add_deploy_flags
from kvbaton.cli.frontend_flags import (
    add_frontend_flags,
    api_key,
    busy_thresholds,
    canary_settings,
    migration_settings,
    reasoning,
    responses_store_bytes,
    tool_format,
)
from kvbaton.cli.planner import add_planner_flags
from kvbaton.cli.profile import add_profile_flags
from kvbaton.cli.routing import add_router_flags, router_settings
from kvbaton.cli.stacks import dump_stacks_on
from kvbaton.cli.supervised import end_with_supervisor
from kvbaton.cli.worker import add_worker_flags
from kvbaton.runtime import DistributedRuntime, RuntimeSettings, RuntimeShutDownError

log = logging.getLogger("kvbaton")


def _runtime_flags(
    parser: argparse.ArgumentParser, *, system_port: bool = False, own_port: bool = True
) -> None:
    """The runtime's flags; `system_port` for the commands that serve /live and /health on it
    (a worker, a planner); `own_port`: the process has one request-plane port (not `serve`,
    whose children each bind their own)."""
    group = parser.add_argument_group("runtime (flags win over KVBATON_* variables)")
    group.add_argument(
        "--discovery",
        help="file:///dir (default: a per-user dir), mem://name, etcd://host:port[,host:port] "
        "or kubernetes[://NAMESPACE][?api=URL]",
    )
    group.add_argument("--request-plane", help="tcp (default), http or nats (at --nats-url)")
    group.add_argument(
        "--event-plane", help="direct (default: no broker), nats or nats://host:port"
    )
    group.add_argument("--nats-url", help="the NATS server (default nats://127.0.0.1:4222)")
    group.add_argument("--host", help="address to bind and advertise (default 127.0.0.1)")
    if own_port:
        group.add_argument("--request-plane-port", type=int, help="default: any free port")
    group.add_argument("--lease-ttl", type=float, help="seconds (default 10)")
    if system_port:
        group.add_argument(
            "--system-port",
            type=int,
            help="serve /live, /health (200 once serving, 503 while starting or stopping) and "
            "/metrics on --host at this port (default: off)",
        )
    group.add_argument(
        "--drain-timeout",
        type=float,
        metavar="SECONDS",
        help="on SIGTERM: deregister, then let in-flight requests finish this long before "
        "cutting them (a frontend migrates them to another worker; default 10)",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )


ENGINES = (
    "torch: the built-in engine; vllm: vLLM's (its own engine arguments after `--`); mocker: "
    "the built-in scheduler with a timing model instead of a model; fixed: fixed tokens at no "
    "cost"
)


def _http_flags(parser: argparse.ArgumentParser, *, old_port_flag: bool = False) -> None:
    """The HTTP API's address. `old_port_flag`: also take `--port`, the name `serve` once had
    for `--http-port` (kept working, left out of --help)."""
    parser.add_argument("--http-host", default="127.0.0.1", help="address the HTTP API binds")
    parser.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: any free port)")
    if old_port_flag:
        parser.add_argument(
            "--port", dest="http_port", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )


# RuntimeSettings field -> the flag that sets it (args.<name>)
_SETTINGS_FLAGS = {
    "discovery": "discovery",
    "request_plane": "request_plane",
    "event_plane": "event_plane",
    "nats_url": "nats_url",
    "host": "host",
    "port": "request_plane_port",
    "lease_ttl": "lease_ttl",
    "system_port": "system_port",
    "drain_timeout": "drain_timeout",
}


def runtime_settings(args: argparse.Namespace) -> RuntimeSettings:
    """Flags given on the command line, then KVBATON_* variables, then defaults."""
    overrides = {
        field: value
        for field, flag in _SETTINGS_FLAGS.items()
        if (value := getattr(args, flag, None)) is not None
    }
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


def run_on_runtime(
    args: argparse.Namespace,
    body: Callable[[argparse.Namespace, DistributedRuntime], Awaitable[int | None]],
) -> int:
    """Run `body` on a runtime made from the flags until it ends or a signal shuts the runtime
    down (gracefully: deregister, drain); the runtime is shut down either way. Returns the exit
    code `body` returned (None: 0)."""
    runtime = DistributedRuntime(settings=runtime_settings(args))
    code = 0

    async def main() -> None:
        nonlocal code
        try:
            if runtime.settings.system_port is not None:
                log.info("system server at %s", runtime.start_system_server())
            code = await body(args, runtime) or 0
        except RuntimeShutDownError:  # the signal came while `body` was starting
            log.info("stopped before serving")
        finally:
            await runtime.shutdown()

    run_until_signal(main, runtime.shutdown)
    return code


def cmd_worker(args: argparse.Namespace) -> int:
    from kvbaton.cli.worker import run_worker

    return run_on_runtime(args, run_worker)


def cmd_frontend(args: argparse.Namespace) -> int:
    from kvbaton.frontend.server import FrontendServer

    runtime = DistributedRuntime(settings=runtime_settings(args))
    server = FrontendServer(
        runtime,
        namespace=args.namespace,
        host=args.http_host,
        port=args.http_port,
        router=router_settings(args),
        migration=migration_settings(args),
        api_key=api_key(args),
        thresholds=busy_thresholds(args),
        canary=canary_settings(args),
        reasoning=reasoning(args),
        tool_format=tool_format(args),
        reuse_port=args.reuse_port,
        responses_store_bytes=responses_store_bytes(args),
    )

    async def main() -> None:
        try:
            # Printed whatever the log level: `serve` and users look for it.
            await server.serve(
                lambda url: print(f"frontend: OpenAI API at {url}/v1", file=sys.stderr, flush=True)
            )
        finally:
            await runtime.shutdown()

    async def stop() -> None:
        server.stop()

    run_until_signal(main, stop)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from kvbaton.cli.serve import serve

    return serve(args, runtime_settings(args))


def cmd_status(args: argparse.Namespace) -> int:
    from kvbaton.cli.status import status

    return status(runtime_settings(args), args.namespace)


def cmd_profile(args: argparse.Namespace) -> int:
    from kvbaton.cli.profile import profile_command

    return profile_command(args, runtime_settings(args))


def cmd_planner(args: argparse.Namespace) -> int:
    from kvbaton.cli.planner import run_planner

    return run_on_runtime(args, run_planner)


def cmd_pull(args: argparse.Namespace) -> int:
    from kvbaton.llm.model_files import pull

    path = pull(args.model, force=args.force, progress=lambda line: print(line, flush=True))
    print(path)  # the last line is the directory
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from kvbaton.cli.deploy import deploy_command

    return deploy_command(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvbaton.engine import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    ).validate()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate([args.prompt], params)[0]
    print(out.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbaton", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvbaton {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a whole deployment on this machine")
    serve.add_argument("--namespace", default="kvbaton")
    serve.add_argument(
        "--mode",
        choices=["agg", "disagg"],
        default="agg",
        help="agg: workers run whole requests; disagg: prefill workers hand KV to decode ones",
    )
    serve.add_argument("--workers", type=int, default=1, help="agg: number of workers")
    serve.add_argument("--prefill-workers", type=int, default=1, help="disagg: prefill workers")
    serve.add_argument("--decode-workers", type=int, default=1, help="disagg: decode workers")
    _http_flags(serve, old_port_flag=True)
    serve.add_argument(
        "--frontends",
        type=int,
        default=1,
        help="frontend processes sharing the HTTP port (the kernel spreads connections over "
        "them; each is supervised; default 1)",
    )
    serve.add_argument(
        "--engine", choices=["torch", "vllm", "mocker", "fixed"], default="torch", help=ENGINES
    )
    serve.add_argument(
        "--worker-system-ports",
        type=int,
        metavar="FIRST",
        help="the i-th worker (worker-i; disagg: prefill-0.., then decode-0..) serves /live, "
        "/health and /metrics on --host at port FIRST+i, as `kvbaton worker --system-port` "
        "(default: off)",
    )
    add_worker_flags(serve)
    add_router_flags(serve)
    add_frontend_flags(serve)
    _runtime_flags(serve, own_port=False)
    serve.set_defaults(func=cmd_serve)

    frontend = sub.add_parser("frontend", help="run the OpenAI-compatible HTTP frontend")
    frontend.add_argument("--namespace", default="kvbaton")
    _http_flags(frontend)
    frontend.add_argument(
        "--reuse-port",
        action="store_true",
        help="share the HTTP port with other frontends that set it (SO_REUSEPORT: the kernel "
        "spreads connections over them; what kvbaton serve --frontends N does)",
    )
    add_router_flags(frontend)
    add_frontend_flags(frontend)
    _runtime_flags(frontend)
    frontend.set_defaults(func=cmd_frontend)

    worker = sub.add_parser("worker", help="run one worker process")
    worker.add_argument(
        "--role",
        choices=["agg", "prefill", "decode"],
        default="agg",
        help="agg: whole requests; prefill: to the first token, KV handed to a decode worker",
    )
    worker.add_argument(
        "--engine",
        choices=["torch", "vllm", "mocker", "fixed", "echo"],
        default="torch",
        help=f"{ENGINES}; echo: no LLM",
    )
    worker.add_argument("--namespace", default="kvbaton")
    worker.add_argument("--component", help="(default: prefill for --role prefill, else backend)")
    worker.add_argument(
        "--cpu-cores",
        metavar="LIST",
        help="--engine vllm on a CPU: the cores its compute threads are bound to, as vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND (e.g. 0-3); serve gives each of several vLLM workers its share",
    )
    add_worker_flags(worker)
    _runtime_flags(worker, system_port=True)
    worker.set_defaults(func=cmd_worker)

    profile = sub.add_parser(
        "profile", help="measure a worker's prefill or decode curve for the planner"
    )
    add_profile_flags(profile)
    _runtime_flags(profile)
    profile.set_defaults(func=cmd_profile, log_level="WARNING")

    planner = sub.add_parser(
        "planner", help="scale the prefill and decode pools to meet TTFT and ITL targets"
    )
    add_planner_flags(planner)
    _runtime_flags(planner, system_port=True)
    planner.set_defaults(func=cmd_planner)

    pull = sub.add_parser("pull", help="fetch and convert a model into the local cache")
    pull.add_argument("model", nargs="?", default="smollm2")
    pull.add_argument("--force", action="store_true", help="convert again even if cached")
    pull.add_argument("--log-level", default="WARNING")
    pull.set_defaults(func=cmd_pull)

    generate = sub.add_parser("generate", help="complete one prompt with the built-in engine")
    generate.add_argument("prompt")
    generate.add_argument("--model", default="smollm2", help="a pulled model or a directory")
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    generate.add_argument("--log-level", default="WARNING")
    generate.set_defaults(func=cmd_generate)

    status = sub.add_parser("status", help="list the instances discovery knows")
    status.add_argument("--namespace", help="only this namespace")
    _runtime_flags(status)
    status.set_defaults(func=cmd_status)

    deploy = sub.add_parser("deploy", help="write the manifests of a deployment (kubernetes)")
    add_deploy_flags(deploy)
    deploy.set_defaults(func=cmd_deploy, log_level="WARNING")
    return parser


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """kvbaton's arguments, and those after the first `--` of `serve` and `worker` (vLLM's
    engine arguments; another command keeps its `--`)."""
    if argv[:1] not in (["serve"], ["worker"]) or "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


def main(argv: list[str] | None = None) -> None:
    ours, vllm_args = split_passthrough(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(ours)
    args.vllm_args = vllm_args  # `--engine vllm`'s own engine arguments
    end_with_supervisor()
    _setup_logging(args.log_level)
    dump_stacks_on(signal.SIGUSR1)
    try:
        code = args.func(args)
    except (ValueError, OSError) as exc:  # bad input, busy port: say what, not a traceback
        print(f"kvbaton: error: {exc}", file=sys.stderr)
        code = 2
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    sys.exit(code)
