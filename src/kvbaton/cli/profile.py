"""`kvbaton profile --role prefill|decode`: measure a worker's curve for the planner
(planner/profiler.py) and write it as a `Profile` JSON file.

By default it starts one `kvbaton worker --role agg` with the engine flags given, on a private
file discovery directory, and stops it (by PID) at the end, on errors and on SIGINT/SIGTERM.
It measures once the worker's compiled single decode is no longer loading (`--compile auto`,
the default on a CPU: its package may build first, minutes), so that no curve is partly eager.
With `--endpoint ns.component.generate` it measures a worker already running (found through
`--discovery`) instead. If `--output` already holds a profile of the same engine and model, the
other role's curve in it is kept, so both roles can be profiled into one file."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import msgspec

from kvbaton.cli.worker import WORKER_FLAGS, add_worker_flags, check_engine_flags
from kvbaton.engine.config import BUILD_PROGRESS_S, BUILD_WAIT_S
from kvbaton.planner.profiler import ProfilePlan, format_table, measure, merge, open_probe
from kvbaton.planner.types import Profile
from kvbaton.protocols.llm import WorkerLoad
from kvbaton.runtime import DistributedRuntime, RuntimeServiceError, RuntimeSettings

T = TypeVar("T")
NAMESPACE = "profile"  # of the worker it starts, alone in its discovery directory
STOP_TIMEOUT_S = 15.0
RUNTIME_FLAGS = ("request_plane", "event_plane", "nats_url", "host")  # passed on to the worker
POLL_S = 1.0  # of the worker's load, while its compiled decode loads


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas: {text!r}"
        ) from None


def add_profile_flags(parser: argparse.ArgumentParser) -> None:
    plan = ProfilePlan(role="prefill")
    parser.add_argument("--role", required=True, choices=["prefill", "decode"])
    parser.add_argument("--output", required=True, type=Path, help="the Profile JSON file")
    parser.add_argument(
        "--engine",
        choices=["torch", "mocker"],
        default="torch",
        help="the worker's engine (with --endpoint: only the name written in the profile)",
    )
    parser.add_argument(
        "--endpoint",
        help="measure the running worker serving this namespace.component.generate "
        "(found through --discovery) instead of starting one",
    )
    group = parser.add_argument_group("measurement")
    csv = ",".join
    group.add_argument(
        "--prefill-tokens",
        type=_int_list,
        default=plan.prefill_tokens,
        help=f"prompt lengths, ascending (default {csv(map(str, plan.prefill_tokens))})",
    )
    group.add_argument(
        "--decode-batches",
        type=_int_list,
        default=plan.decode_batches,
        help=f"concurrent sequences, ascending (default {csv(map(str, plan.decode_batches))})",
    )
    group.add_argument(
        "--decode-context",
        type=int,
        default=plan.decode_context,
        help=f"prompt tokens of each decoding sequence (default {plan.decode_context})",
    )
    group.add_argument(
        "--decode-tokens",
        type=int,
        default=plan.decode_tokens,
        help=f"tokens each decoding sequence generates (default {plan.decode_tokens})",
    )
    group.add_argument(
        "--repeats",
        type=int,
        default=plan.repeats,
        help=f"prefill requests per point, median taken (default {plan.repeats})",
    )
    group.add_argument(
        "--start-timeout", type=float, default=120.0, help="seconds the worker may take to start"
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=plan.request_timeout,
        help=f"seconds one measurement may take (default {plan.request_timeout:g})",
    )
    add_worker_flags(parser)


def profile_command(args: argparse.Namespace, settings: RuntimeSettings) -> int:
    plan = ProfilePlan(
        role=args.role,
        prefill_tokens=args.prefill_tokens,
        decode_batches=args.decode_batches,
        decode_context=args.decode_context,
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
        request_timeout=args.request_timeout,
    ).check()
    if args.start_timeout <= 0:
        raise ValueError("--start-timeout must be positive")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    async def run(runtime: DistributedRuntime, endpoint: str, alive: Callable[[], None]) -> Profile:
        try:
            probe = await open_probe(runtime, endpoint, args.start_timeout, alive)
            try:
                await _settled(runtime, endpoint, args.start_timeout, alive, progress)
                return await measure(probe, plan, args.engine, progress)
            finally:
                await probe.client.close()
        finally:
            await runtime.shutdown()

    try:
        if args.endpoint is not None:
            profile = _run(lambda: run(DistributedRuntime(settings=settings), args.endpoint, _ok))
        else:
            if args.discovery is not None:
                raise ValueError("--discovery is for measuring a running worker: add --endpoint")
            check_engine_flags(args)
            profile = _with_worker(args, settings, run)
    except (RuntimeError, RuntimeServiceError) as exc:  # the worker failed, or a measurement
        print(f"kvbaton profile: error: {exc}", file=sys.stderr)
        return 1
    except asyncio.CancelledError:
        print("kvbaton profile: interrupted", file=sys.stderr)
        return 130
    profile = merge(profile, _read_profile(args.output))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(profile.to_json() + b"\n")
    if args.role == "prefill":
        print(
            f"prefill of {profile.model} ({profile.engine}): prompt tokens -> time to first token"
        )
        print(format_table(profile.prefill, "tokens", "ms"))
    else:
        print(
            f"decode of {profile.model} ({profile.engine}) at {profile.decode_context} tokens of "
            "context: concurrent sequences -> inter-token latency"
        )
        print(format_table(profile.decode, "batch", "ITL ms"))
    print(args.output)  # the last line is the file
    return 0


async def _settled(
    runtime: DistributedRuntime,
    endpoint: str,
    timeout: float,
    alive: Callable[[], None],
    progress: Callable[[str], None],
) -> None:
    """`settle_compiled_decode` of the workers serving `endpoint`, through their `load_metrics`
    (a worker still loading, while any is)."""
    component = endpoint.rsplit(".", 1)[0]
    client = await runtime.endpoint(f"{component}.load_metrics").client(response_type=WorkerLoad)

    async def slowest() -> WorkerLoad:
        ids = client.instance_ids() or await client.wait_for_instances(timeout)
        loads: list[WorkerLoad] = [
            await anext(client.direct(None, i, timeout=timeout)) for i in ids
        ]
        return next((load for load in loads if load.compiled_decode == "loading"), loads[0])

    try:
        state = await settle_compiled_decode(slowest, alive, progress)
    finally:
        await client.close()
    if state == "failed":
        progress("profile: the worker's compiled decode failed (its log says why): it runs eagerly")


async def settle_compiled_decode(
    load: Callable[[], Awaitable[WorkerLoad]],
    alive: Callable[[], None],
    progress: Callable[[str], None],
    poll_s: float = POLL_S,
) -> str:
    """Wait while the worker's compiled single decode is loading (`compiled_decode` in its
    `load()`): a curve measured partly eager and partly compiled would be neither. Returns the
    state it settled in.

    - Says how long it has waited every `BUILD_PROGRESS_S`; raises after `BUILD_WAIT_S`, or as soon
      as `alive()` does.
    """
    start = said = time.monotonic()
    while (state := (await load()).compiled_decode) == "loading":
        alive()
        waited = time.monotonic() - start
        if waited > BUILD_WAIT_S:
            raise RuntimeError(f"the worker's compiled decode still loads after {waited:.0f} s")
        if time.monotonic() - said >= BUILD_PROGRESS_S:
            progress(f"waiting {waited:.0f} s for the worker's compiled single decode to load")
            said = time.monotonic()
        await asyncio.sleep(poll_s)
    return state


def _ok() -> None:
    pass


def _read_profile(path: Path) -> Profile | None:
    try:
        return Profile.from_json(path.read_bytes())
    except (OSError, msgspec.DecodeError):  # (ValidationError is a DecodeError)
        return None


def _run(main: Callable[[], Awaitable[T]]) -> T:
    """`main()` in an event loop; SIGINT and SIGTERM cancel it (asyncio.CancelledError)."""
    from kvbaton.cli.main import run_until_signal

    result: list[T] = []
    task: list[asyncio.Task[object]] = []

    async def body() -> None:
        current = asyncio.current_task()
        assert current is not None
        task.append(current)
        result.append(await main())

    async def cancel() -> None:
        task[0].cancel()

    run_until_signal(body, cancel)
    return result[0]


def _with_worker(
    args: argparse.Namespace,
    settings: RuntimeSettings,
    run: Callable[[DistributedRuntime, str, Callable[[], None]], Awaitable[Profile]],
) -> Profile:
    """Start the worker, measure it with `run`, stop it whatever happens."""
    from kvbaton.llm.model_files import KNOWN_MODELS, pull

    if args.model in KNOWN_MODELS:  # a pulled model is only looked at
        pull(args.model, progress=lambda line: print(line, file=sys.stderr, flush=True))
    private_dir = Path(tempfile.mkdtemp(prefix="kvbaton-profile-"))
    discovery = f"file://{private_dir / 'discovery'}"
    log_path = private_dir / "worker.log"
    command = [sys.executable, "-m", "kvbaton", "worker", "--role", "agg", "--engine"]
    command += [args.engine, "--namespace", NAMESPACE, "--discovery", discovery]
    command += [*_flags(args, WORKER_FLAGS), *_flags(args, RUNTIME_FLAGS), "--log-level", "WARNING"]
    with open(log_path, "wb") as log:
        # Its own session: a Ctrl-C in the terminal reaches this process, which stops it.
        worker = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    print(f"profile: worker {worker.pid} started", file=sys.stderr, flush=True)

    def tail() -> str:
        lines = log_path.read_text(errors="replace").splitlines()[-20:]
        return "\n".join(lines) or "(empty)"

    def alive() -> None:
        code = worker.poll()
        if code is not None:
            raise RuntimeServiceError(f"the worker exited (code {code}); its log ends:\n{tail()}")

    try:
        runtime = DistributedRuntime(discovery, settings=settings)
        return _run(lambda: run(runtime, f"{NAMESPACE}.backend.generate", alive))
    except TimeoutError as exc:
        raise RuntimeServiceError(f"{exc}; the worker's log ends:\n{tail()}") from exc
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        shutil.rmtree(private_dir, ignore_errors=True)


def _flags(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out
