"""The NIXL transfer poller, on a stand-in agent: one thread checks every transfer in flight
and wakes its waiter with the end state, an error, or a timeout; a handle is not touched once
its waiter stopped waiting; closing wakes any waiter; a poller let go is collected."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

import pytest

from kvbaton.kv_transfer.nixl_poller import TransferPoller

pytestmark = pytest.mark.unit


class FakeAgent:
    """Each handle is a list of the states its checks answer, the last one repeated (an
    exception is raised); a check of a released handle is recorded as a fault."""

    def __init__(self) -> None:
        self.checked: list[tuple[str, Any]] = []  # (thread name, handle)
        self.released: set[int] = set()
        self.faults: list[Any] = []  # released handles that were checked

    def check_xfer_state(self, handle: list[Any]) -> str:
        if id(handle) in self.released:
            self.faults.append(handle)
        self.checked.append((threading.current_thread().name, handle))
        state = handle.pop(0) if len(handle) > 1 else handle[0]
        if isinstance(state, Exception):  # a new one each time, as NIXL's
            raise type(state)(*state.args)
        return str(state)


@pytest.fixture
def poller() -> Any:
    made = TransferPoller(FakeAgent(), "test")
    yield made
    made.close()


def test_waiters_get_their_transfers_end_states(poller: TransferPoller) -> None:
    results: dict[int, str] = {}

    def wait(i: int, handle: list[Any]) -> None:
        results[i] = poller.wait(handle, time.monotonic() + 10)

    handles = [["PROC"] * (i + 1) + ["DONE" if i % 2 else "ERR"] for i in range(6)]
    waiters = [threading.Thread(target=wait, args=(i, h)) for i, h in enumerate(handles)]
    for waiter in waiters:
        waiter.start()
    for waiter in waiters:
        waiter.join(10)
    assert results == {i: "DONE" if i % 2 else "ERR" for i in range(6)}
    agent = poller._agent
    assert {name for name, _ in agent.checked} == {"nixl-poller-test"}


def test_a_timeout_leaves_the_handle_untouched_after(poller: TransferPoller) -> None:
    agent = poller._agent
    handle = ["PROC"]
    with pytest.raises(TimeoutError):
        poller.wait(handle, time.monotonic() + 0.2)
    assert any(h is handle for _, h in agent.checked)  # it was checked while waited for
    seen = len(agent.checked)
    agent.released.add(id(handle))  # (as NIXL's release would: a check now is a fault)
    time.sleep(0.1)  # some 200 polling rounds, were it still in the list
    assert not agent.faults and not any(h is handle for _, h in agent.checked[seen:])
    assert not poller._in_flight


def test_an_error_checking_a_transfer_reaches_its_waiter(poller: TransferPoller) -> None:
    with pytest.raises(KeyError, match="gone"):
        poller.wait(["PROC", KeyError("gone")], time.monotonic() + 10)


def test_closing_wakes_a_waiter() -> None:
    poller = TransferPoller(FakeAgent(), "closing")
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            poller.wait(["PROC"], time.monotonic() + 30)
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    while not poller._in_flight:
        time.sleep(0.01)
    started = time.monotonic()
    poller.close()
    waiter.join(5)
    assert [type(e) for e in errors] == [RuntimeError] and time.monotonic() - started < 5
    assert not poller._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        poller.wait(["DONE"], time.monotonic() + 1)


def test_a_poller_let_go_is_collected_and_its_thread_ends() -> None:
    """(Even after it reported an error: no reference cycle holds it.)"""
    poller = TransferPoller(FakeAgent(), "dropped")
    assert poller.wait(["PROC", "DONE"], time.monotonic() + 5) == "DONE"
    with pytest.raises(KeyError):
        poller.wait(["PROC", KeyError("gone")], time.monotonic() + 5)
    thread = poller._thread
    gone = weakref.ref(poller)
    gc.disable()  # freed as its last reference goes, not by the cycle collector
    try:
        del poller
        for _ in range(50):  # (its thread may hold it for a moment)
            if gone() is None:
                break
            time.sleep(0.1)
        assert gone() is None
    finally:
        gc.enable()
    thread.join(5)
    assert not thread.is_alive()
