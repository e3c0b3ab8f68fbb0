"""A process stopped by a signal (Ctrl-C, SIGTERM) while it is still starting (loading its
engine, say) stops there: exit 0 and a log line, not a traceback from the call that would have
begun serving on the runtime the signal shut down."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import uuid

import pytest

from kvbaton.cli.main import build_parser, run_on_runtime
from kvbaton.runtime import DistributedRuntime, RuntimeShutDownError

pytestmark = pytest.mark.unit


def test_a_signal_while_starting_stops_the_process_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    args = build_parser().parse_args(["worker", "--discovery", f"mem://{uuid.uuid4().hex}"])
    reached: list[str] = []

    async def starting(_: argparse.Namespace, runtime: DistributedRuntime) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the engine would load
        await asyncio.wait_for(runtime.wait_for_shutdown(), 10)
        reached.append("loaded")
        await runtime.ensure_instance_id()  # what a worker does once its engine loaded
        reached.append("served")

    with caplog.at_level(logging.INFO, logger="kvbaton"):
        assert run_on_runtime(args, starting) == 0
    assert reached == ["loaded"]
    assert "stopped before serving" in caplog.text


async def test_serving_on_a_shut_down_runtime_says_so() -> None:
    runtime = DistributedRuntime(f"mem://{uuid.uuid4().hex}")
    await runtime.shutdown()
    with pytest.raises(RuntimeShutDownError, match="shut down"):
        await runtime.ensure_instance_id()
