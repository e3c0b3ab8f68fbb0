"""A decode-first push writes nothing until the decode worker let it (its room claimed), then
each layer as the engine reports it, into the target's blocks at the same prompt positions;
layers reported while a write runs go in one write; `finish` writes whole what was not streamed
(blocks found in the prefix cache, everything after a chunk was computed again) and raises if a
write failed; after `stop` nothing more is written."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from kvbaton.disagg.prefill_side import PrefillSide
from kvbaton.disagg.push import LayerPush, PushState
from kvbaton.engine.connector import KvCacheView, PromptChunk
from kvbaton.protocols.llm import KvPoolInfo, KvTarget
from tests.helpers import wait_until
from tests.workers.fakes import POOL

pytestmark = pytest.mark.unit

LAYERS, LAYER_BYTES, BLOCKS = 4, 8, 16
BLOCK = 4  # tokens


class FakeAgent:
    """Moves bytes between two arrays as a transfer agent would (ours -> the peer's); a write
    may be held until `gate` is set, or fail (with `fail`); one that times out may still land
    for `linger` seconds."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.ours = rng.integers(1, 256, (BLOCKS, LAYERS * LAYER_BYTES), np.uint8)
        self.theirs = np.zeros_like(self.ours)
        self.writes: list[tuple[list[int], list[int], tuple[int, int] | None]] = []
        self.timeout_s = 5.0
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.fail: type[Exception] | None = None
        self.linger = 0.0

    def write(
        self,
        peer: KvPoolInfo,
        src: list[int],
        dst: list[int],
        layers: tuple[int, int] | None = None,
    ) -> str:
        self.started.set()
        assert self.gate.wait(5)
        if self.fail is not None:
            raise self.fail("the peer is gone")
        part = slice(None) if layers is None else slice(*(n * LAYER_BYTES for n in layers))
        self.theirs[dst, part] = self.ours[src, part]
        if src:
            self.writes.append((src, dst, layers))
        return "fake"

    def linger_s(self, peer: KvPoolInfo, op: str) -> float:
        assert op == "write"
        return self.linger


@pytest.fixture
def writers() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    pool = concurrent.futures.ThreadPoolExecutor(2)
    yield pool
    pool.shutdown()


def target(block_ids: list[int], first_block: int = 0) -> KvTarget:
    pool = KvPoolInfo(layout="test", num_blocks=BLOCKS, block_bytes=LAYERS * LAYER_BYTES, host="")
    return KvTarget(
        decode_instance_id=1,
        decode_component="ns.backend",
        room="room",
        block_ids=block_ids,
        first_block=first_block,
        block_size=BLOCK,
        pool=pool,
    )


def push(
    agent: FakeAgent, writers: concurrent.futures.Executor, dst: list[int], first_block: int = 0
) -> LayerPush:
    view = KvCacheView("test", BLOCKS, LAYERS * LAYER_BYTES, None, num_layers=LAYERS)
    made = LayerPush("r", target(dst, first_block), agent, view, writers)  # type: ignore[arg-type]
    made.claimed(True)
    return made


def held_push(writers: concurrent.futures.Executor) -> tuple[FakeAgent, LayerPush]:
    """A push into DST whose writes wait until `agent.gate` is set."""
    agent = FakeAgent()
    agent.gate.clear()
    return agent, push(agent, writers, DST)


def quiesce(p: LayerPush, timeout_s: float) -> None:
    """Until no write runs."""
    with p._cond:
        assert p._cond.wait_for(lambda: not p._writing, timeout_s), "a KV write still runs"


def compute(p: LayerPush, chunk: PromptChunk) -> None:
    for layer in range(LAYERS):
        p.layer_written(chunk, layer)


PROMPT = [3, 5, 6]  # our blocks of a 10-token prompt
DST = [9, 2, 11]


def test_each_layer_is_written_as_it_is_reported(
    writers: concurrent.futures.ThreadPoolExecutor,
) -> None:
    agent = FakeAgent()
    p = push(agent, writers, DST)
    chunk = PromptChunk(0, 10, 0, PROMPT)
    for layer in range(LAYERS):
        p.layer_written(chunk, layer)
        for _ in range(500):  # the writer takes it up without waiting for the next layer
            if agent.writes and agent.writes[-1][2] == (layer, layer + 1):
                break
            threading.Event().wait(0.01)
        assert agent.writes[-1] == (PROMPT, DST, (layer, layer + 1))
    p.finish(PROMPT)
    assert len(agent.writes) == LAYERS and p.writes == LAYERS  # nothing more at the end
    assert np.array_equal(agent.theirs[DST], agent.ours[PROMPT])


def test_layers_reported_during_a_write_go_in_one_write(
    writers: concurrent.futures.ThreadPoolExecutor,
) -> None:
    agent, p = held_push(writers)
    chunks = [PromptChunk(0, 6, 0, PROMPT[:2]), PromptChunk(6, 10, 1, PROMPT[1:])]
    p.layer_written(chunks[0], 0)
    assert agent.started.wait(5)  # layer 0 is being written
    for layer in range(1, LAYERS):
        p.layer_written(chunks[0], layer)
    compute(p, chunks[1])
    agent.gate.set()
    p.finish(PROMPT)
    assert [w[2] for w in agent.writes] == [(0, 1), (1, LAYERS), (0, LAYERS)]
    assert agent.writes[2][:2] == (PROMPT[1:], DST[1:])
    assert np.array_equal(agent.theirs[DST], agent.ours[PROMPT])


def test_only_the_targets_blocks_are_written(
    writers: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """The decode worker has the first block cached: it gets blocks 1 and 2 only."""
    agent = FakeAgent()
    p = push(agent, writers, DST[1:], first_block=1)
    compute(p, PromptChunk(0, 10, 0, PROMPT))
    p.finish(PROMPT)
    assert {tuple(w[0]) for w in agent.writes} == {tuple(PROMPT[1:])}
    assert np.array_equal(agent.theirs[DST[1:]], agent.ours[PROMPT[1:]])
    assert not agent.theirs[DST[0]].any()


def test_blocks_found_in_the_prefix_cache_go_whole_at_the_end(
    writers: concurrent.futures.ThreadPoolExecutor,
) -> None:
    agent = FakeAgent()
    p = push(agent, writers, DST)
    compute(p, PromptChunk(8, 10, 2, PROMPT[2:]))  # blocks 0 and 1 were cached here
    p.finish(PROMPT)
    assert agent.writes[-1] == (PROMPT[:2], DST[:2], None)
    assert np.array_equal(agent.theirs[DST], agent.ours[PROMPT])


def test_a_chunk_computed_again_rewrites_every_block_at_the_end(
    writers: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """Preempted after its first chunk, the prompt is computed again in other blocks: what
    was streamed may have been read from blocks reused meanwhile."""
    agent = FakeAgent()
    p = push(agent, writers, DST)
    compute(p, PromptChunk(0, 6, 0, [7, 8]))
    final = [3, 5, 6]
    compute(p, PromptChunk(0, 10, 0, final))  # again from the start
    p.finish(final)
    assert agent.writes[-1] == (final, DST, None)
    assert np.array_equal(agent.theirs[DST], agent.ours[final])


def test_a_failed_write_fails_the_push_and_ends_its_writes(
    writers: concurrent.futures.ThreadPoolExecutor,
) -> None:
    agent = FakeAgent()
    agent.fail = ConnectionError
    p = push(agent, writers, DST)
    chunk = PromptChunk(0, 10, 0, PROMPT)
    compute(p, chunk)
    with pytest.raises(ConnectionError, match="gone"):
        p.finish(PROMPT)
    assert not agent.writes


@pytest.mark.parametrize("error", [TimeoutError, ConnectionError, ValueError])
def test_a_write_that_failed_may_land_for_the_agents_linger(
    writers: concurrent.futures.ThreadPoolExecutor, error: type[Exception]
) -> None:
    """A write that timed out or broke off may still land (over NIXL, or a TCP write the
    peer's server takes): the push says for how long, for its report to the decode worker; one
    refused before it began (a bad request) has ended."""
    agent = FakeAgent()
    agent.fail, agent.linger = error, 30.0
    p = push(agent, writers, DST)
    compute(p, PromptChunk(0, 10, 0, PROMPT))
    with pytest.raises(error):
        p.finish(PROMPT)
    left = p.linger_left()
    assert 20.0 < left <= 30.0 if issubclass(error, OSError) else left == 0.0


def test_no_write_starts_after_the_claims_wait_ran_out(
    writers: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """`write_until` holds in the writer's thread itself, whatever the event loop does."""
    agent = FakeAgent()
    p = push(agent, writers, DST)
    p.write_until = time.monotonic() - 1.0
    compute(p, PromptChunk(0, 10, 0, PROMPT))
    with pytest.raises(ConnectionError, match="may no longer wait"):
        p.finish(PROMPT)
    assert not agent.writes and not agent.started.is_set()


def test_nothing_is_written_after_stop(writers: concurrent.futures.ThreadPoolExecutor) -> None:
    agent, p = held_push(writers)
    chunk = PromptChunk(0, 10, 0, PROMPT)
    p.layer_written(chunk, 0)
    assert agent.started.wait(5)
    p.layer_written(chunk, 1)  # pending when stopped: dropped
    stopper = threading.Thread(target=p.stop)
    stopper.start()
    threading.Event().wait(0.05)
    assert stopper.is_alive()  # stop waits for the write that runs
    agent.gate.set()
    stopper.join(5)
    assert not stopper.is_alive()
    p.layer_written(chunk, 2)
    writers.shutdown(wait=True)
    assert [w[2] for w in agent.writes] == [(0, 1)]


def test_stop_waits_for_a_write_past_the_timeout(
    writers: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """The decode worker reuses its blocks once told the writes ended: stop never returns
    while one runs, even a write slower than the agent's timeout."""
    agent, p = held_push(writers)
    agent.timeout_s = 0.05
    p.layer_written(PromptChunk(0, 10, 0, PROMPT), 0)
    assert agent.started.wait(5)
    stopper = threading.Thread(target=p.stop)
    stopper.start()
    stopper.join(0.3)  # six timeouts
    assert stopper.is_alive()
    agent.gate.set()
    stopper.join(5)
    assert not stopper.is_alive()


def test_stop_waits_for_the_whole_block_write_of_finish(
    writers: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """The request is cancelled while `finish` writes: the blocks go back only after it."""
    agent, p = held_push(writers)
    finisher = threading.Thread(target=p.finish, args=(PROMPT,))
    finisher.start()
    assert agent.started.wait(5)
    stopper = threading.Thread(target=p.stop)
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive()
    agent.gate.set()
    stopper.join(5)
    finisher.join(5)
    assert not stopper.is_alive() and not finisher.is_alive()
    assert agent.writes == [(PROMPT, DST, None)]


def test_finish_after_stop_writes_nothing(writers: concurrent.futures.ThreadPoolExecutor) -> None:
    """The request was cancelled while `finish` waited for the streamed writes: once `stop`
    returned, the blocks may be reused on both sides."""
    agent = FakeAgent()
    p = push(agent, writers, DST)
    p.stop()
    with pytest.raises(ConnectionError, match="stopped"):
        p.finish(PROMPT)
    assert not agent.writes


def test_layers_wait_for_the_claim_and_a_refused_claim_writes_nothing(
    writers: concurrent.futures.ThreadPoolExecutor,
) -> None:
    view = KvCacheView("test", BLOCKS, LAYERS * LAYER_BYTES, None, num_layers=LAYERS)
    for ok in (True, False):
        agent = FakeAgent()
        p = LayerPush("r", target(DST), agent, view, writers)  # type: ignore[arg-type]
        compute(p, PromptChunk(0, 10, 0, PROMPT))
        threading.Event().wait(0.05)
        assert not agent.writes  # not claimed yet
        p.claimed(ok)
        if ok:
            p.finish(PROMPT)  # the layers told before the claim, in one write
            assert agent.writes == [(PROMPT, DST, (0, LAYERS))]
        else:
            with pytest.raises(ConnectionError, match="no longer waits"):
                p.finish(PROMPT)
            assert not agent.writes and p.state is PushState.STOPPED


def test_a_claim_the_decode_worker_ends_stops_the_writes(
    writers: concurrent.futures.ThreadPoolExecutor,
) -> None:
    agent = FakeAgent()
    p = push(agent, writers, DST)
    chunk = PromptChunk(0, 10, 0, PROMPT)
    p.layer_written(chunk, 0)
    quiesce(p, 5)
    p.claimed(False)  # the decode worker stopped waiting
    p.layer_written(chunk, 1)
    with pytest.raises(ConnectionError, match="no longer waits"):
        p.finish(PROMPT)
    writers.shutdown(wait=True)
    assert [w[2] for w in agent.writes] == [(0, 1)]


def test_a_prompt_the_target_does_not_fit_is_refused(
    writers: concurrent.futures.ThreadPoolExecutor,
) -> None:
    agent = FakeAgent()
    p = push(agent, writers, [*DST, 12])
    with pytest.raises(ValueError, match="do not fit"):
        p.finish(PROMPT)


async def test_a_write_stalled_on_one_decode_worker_holds_up_no_other_push(
    prefill_side: PrefillSide,
) -> None:
    """A hung decode worker keeps each write to it for up to the transfer timeout: pushes to
    another decode worker go on meanwhile, however many are stalled (one writer each)."""
    stalled = threading.Event()
    started: list[str] = []
    written: list[str] = []

    def write(pool: KvPoolInfo, src: list[int], dst: list[int], layers: object = None) -> str:
        started.append(pool.host)
        if pool.host == "hung":
            assert stalled.wait(10)
        written.append(pool.host)
        return "fake"

    side = prefill_side
    side.agent.write = write  # type: ignore[attr-defined]

    def push_to(host: str, handle: str) -> LayerPush:
        made = LayerPush(
            handle,
            msgspec.structs.replace(target([2]), pool=msgspec.structs.replace(POOL, host=host)),
            side.agent,
            side.cache,
            side._writers,
        )
        made.claimed(True)
        made.layer_written(PromptChunk(0, BLOCK, 0, [5]), 0)
        return made

    hung = [push_to("hung", f"h{i}") for i in range(8)]
    try:
        await wait_until(lambda: len(started) == 8, 5, "the 8 stalled writes at once")
        push_to("fine", "f")
        await wait_until(lambda: "fine" in written, 5, "the other decode worker's write")
    finally:
        stalled.set()
    for made in hung:
        made.stop()
    assert written.count("hung") == 8
