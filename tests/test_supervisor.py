"""The supervisor of `kvbaton serve`, on small Python children: restarts with backoff, the slots
that stop the deployment, a graceful stop, the state file."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbaton.cli.supervisor import Backoff, ChildSpec, SlotState, Supervisor
from tests.helpers import wait_until_sync

pytestmark = pytest.mark.unit

FAST = Backoff(first=0.01, most=0.04, reset_after_s=60.0)

# A child that says it is ready (a file named by its PID) and, told by argv, then: serves until
# signalled ("serve"), exits 1 once the supervisor saw it ready ("crash"), or does so only the
# first time and later fails at once ("crash-once"); "stubborn" serves until killed (it ignores
# SIGTERM) and leaves a file on each SIGUSR1; "fails-to-stop" serves, and exits 1 on SIGTERM.
CHILD = """
import os, signal, sys, time
mode, folder = sys.argv[1], sys.argv[2]
if mode == "fails-to-stop":
    signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
    mode = "serve"
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    usr1 = os.path.join(folder, str(os.getpid()) + ".usr1")
    signal.signal(signal.SIGUSR1, lambda *_: open(usr1, "w").close())
    mode = "serve"
if mode == "crash-once" and os.path.exists(os.path.join(folder, "been-ready")):
    print("cannot start again: port in use", flush=True)
    sys.exit(2)
if mode == "fail":
    print("loading the model", flush=True)
    print("error: no such model: /nope", flush=True)
    sys.exit(3)
pid = str(os.getpid())
open(os.path.join(folder, pid), "w").close()
while mode != "serve" and not os.path.exists(os.path.join(folder, pid + ".seen")):
    time.sleep(0.005)
if mode == "serve":
    time.sleep(600)
open(os.path.join(folder, "been-ready"), "w").close()
sys.exit(1)
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "child.py").write_text(CHILD)
    return tmp_path


def spec(folder: Path, mode: str, name: str = "worker-0") -> ChildSpec:
    def ready(pid: int) -> bool:
        if not (folder / str(pid)).exists():
            return False
        (folder / f"{pid}.seen").touch()  # the child may go on (and crash)
        return True

    command = [sys.executable, str(folder / "child.py"), mode, str(folder)]
    return ChildSpec(name, lambda: command, ready)


@pytest.fixture
def running() -> Iterator[list[tuple[Supervisor, threading.Thread, list[int]]]]:
    """Supervisors run in threads; each is stopped at the end."""
    started: list[tuple[Supervisor, threading.Thread, list[int]]] = []
    yield started
    for supervisor, thread, _ in started:
        supervisor.stop()
        thread.join(30)


def run_in_thread(
    supervisor: Supervisor, started: list[tuple[Supervisor, threading.Thread, list[int]]]
) -> list[int]:
    code: list[int] = []
    thread = threading.Thread(target=lambda: code.append(supervisor.run()))
    thread.start()
    started.append((supervisor, thread, code))
    return code


def test_backoff_doubles_to_its_most_and_starts_over_after_a_long_serve() -> None:
    backoff = Backoff()
    waits = [0.0]
    for _ in range(7):
        waits.append(backoff.next(waits[-1], 5.0))
    assert waits[1:] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.next(30, 60.0) == 1  # it had served a minute
    assert backoff.next(8, None) == 16  # a failed start does not reset it


def test_a_child_that_crashes_right_after_it_is_ready_is_restarted_each_time(
    folder: Path, running: list[tuple[Supervisor, threading.Thread, list[int]]]
) -> None:
    supervisor = Supervisor([spec(folder, "crash")], {}, backoff=FAST, max_failed_starts=5)
    code = run_in_thread(supervisor, running)
    slot = supervisor.slots[0]
    wait_until_sync(lambda: slot.restarts >= 7, timeout=60, what="7 restarts")
    assert not code  # still running: more than max_failed_starts crashes, each after ready
    assert slot.last_exit == "code 1" and slot.failed_starts == 0
    assert slot.wait == FAST.most


def test_a_child_that_fails_its_first_start_stops_the_deployment_with_its_last_lines(
    folder: Path,
) -> None:
    supervisor = Supervisor([spec(folder, "fail")], {}, backoff=FAST)
    assert supervisor.run() == 1
    assert "worker-0 (pid" in supervisor.failure
    assert "failed its first start before it was ready (code 3)" in supervisor.failure
    assert "[worker-0] error: no such model: /nope" in supervisor.failure
    assert supervisor.slots[0].state is SlotState.STOPPED


def test_five_failed_starts_in_a_row_stop_the_deployment(folder: Path) -> None:
    supervisor = Supervisor([spec(folder, "crash-once")], {}, backoff=FAST, max_failed_starts=5)
    assert supervisor.run() == 1
    assert supervisor.slots[0].restarts == 5  # ready once, then 5 starts that failed
    assert "failed 5 starts in a row" in supervisor.failure
    assert "[worker-0] cannot start again: port in use" in supervisor.failure


def test_a_child_never_ready_is_killed_after_the_ready_timeout(folder: Path) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    never = ChildSpec("worker-0", lambda: sleeper, lambda pid: False)
    supervisor = Supervisor([never], {}, backoff=FAST, ready_timeout_s=0.3)
    assert supervisor.run() == 1
    assert "not ready after 0.3 s; killed" in supervisor.failure


def test_a_stop_ends_every_child_and_removes_the_state_file(
    folder: Path, running: list[tuple[Supervisor, threading.Thread, list[int]]]
) -> None:
    state = folder / "serve-1.json"
    specs = [spec(folder, "serve", "frontend"), spec(folder, "serve", "worker-0")]
    supervisor = Supervisor(specs, {}, backoff=FAST, state_file=state, state_extra={"x": 1})

    def slot_states() -> list[str]:
        try:
            return [s["state"] for s in json.loads(state.read_text())["slots"]]
        except FileNotFoundError:
            return []

    announced = threading.Event()
    supervisor.announce = lambda: bool(announced.set() or True)
    code = run_in_thread(supervisor, running)
    wait_until_sync(announced.is_set, timeout=30, what="every slot ready")
    wait_until_sync(lambda: slot_states() == ["ready", "ready"], what="the state file")
    body = json.loads(state.read_text())
    assert body["x"] == 1
    pids = [s["pid"] for s in body["slots"]]
    assert pids == [s.process.pid for s in supervisor.slots if s.process]
    supervisor.stop()
    running[0][1].join(30)
    assert code == [0]
    assert not state.exists()
    assert all(s.process and s.process.returncode == -15 for s in supervisor.slots)
    assert all(s.state is SlotState.STOPPED for s in supervisor.slots)


def test_a_stack_dump_asked_while_it_stops_reaches_the_children_that_were_ready(
    folder: Path, running: list[tuple[Supervisor, threading.Thread, list[int]]]
) -> None:
    """A deployment that hangs as it stops is when its stacks are wanted."""
    supervisor = Supervisor([spec(folder, "stubborn")], {}, backoff=FAST, stop_timeout_s=10)
    announced = threading.Event()
    supervisor.announce = lambda: bool(announced.set() or True)
    code = run_in_thread(supervisor, running)
    wait_until_sync(announced.is_set, timeout=30, what="the slot ready")
    (slot,) = supervisor.slots
    assert slot.process is not None
    supervisor.stop()
    wait_until_sync(lambda: slot.state is SlotState.STOPPING, what="the stop under way")
    supervisor.pass_on_stack_dump()  # (what serve's SIGUSR1 handler does)
    dumped = folder / f"{slot.process.pid}.usr1"
    wait_until_sync(dumped.exists, timeout=5, what="the child asked for its stacks")
    running[0][1].join(30)
    assert code == [1] and slot.process.returncode == -9  # it ignored SIGTERM: killed


def test_a_child_killed_or_failing_as_the_deployment_stops_makes_it_exit_1(
    folder: Path, running: list[tuple[Supervisor, threading.Thread, list[int]]]
) -> None:
    """An operator (or a test) learns from the exit code that a child hung or failed as it
    stopped; each one's end is in its slot."""
    specs = [
        spec(folder, "serve"),
        spec(folder, "stubborn", name="w1"),
        spec(folder, "fails-to-stop", name="w2"),
    ]
    supervisor = Supervisor(specs, {}, backoff=FAST, stop_timeout_s=0.5)
    announced = threading.Event()
    supervisor.announce = lambda: bool(announced.set() or True)
    code = run_in_thread(supervisor, running)
    wait_until_sync(announced.is_set, timeout=30, what="every slot ready")
    supervisor.stop()
    running[0][1].join(30)
    returncodes = [s.process.returncode for s in supervisor.slots if s.process]
    assert code == [1] and returncodes == [-15, -9, 1]
    assert [s.last_exit for s in supervisor.slots] == ["", "signal SIGKILL", "code 1"]


def test_a_deployment_never_announced_stops_after_the_ready_timeout(folder: Path) -> None:
    supervisor = Supervisor(
        [spec(folder, "serve")], {}, ready_timeout_s=0.5, announce=lambda: False
    )
    assert supervisor.run() == 1
    assert supervisor.failure == "not serving after 0.5 s"
    assert supervisor.slots[0].process and supervisor.slots[0].process.returncode == -15


# Stops a supervisor with no slots from a trace function at its loop's k-th line (a trace
# function runs where a signal handler can: between any two lines of the main thread, inside
# the standard library's locked sections too), for each k in turn; prints how many it stopped.
STOP_AT_EVERY_LINE = """
import sys
import kvbaton.cli.supervisor as supervisor_module
from kvbaton.cli.supervisor import Supervisor

supervisor_module.TICK_S = 0.001
for k in range(1, 301):
    supervisor = Supervisor([], {})
    lines = 0

    def trace(frame, event, arg):
        def local(frame, event, arg):
            global lines
            if event == "line":
                lines += 1
                if lines == k:
                    supervisor.stop()
            return local
        return local

    sys.settrace(trace)
    code = supervisor.run()
    sys.settrace(None)
    assert code == 0, code
print(k, flush=True)
"""


def test_a_stop_asked_between_any_two_lines_of_the_loop_ends_it() -> None:
    """As serve's SIGINT handler may run: a stop that waited on a lock its own thread held
    would hang the deployment forever."""
    done = subprocess.run(
        [sys.executable, "-c", STOP_AT_EVERY_LINE], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (0, "300\n"), done.stderr[-2000:]
