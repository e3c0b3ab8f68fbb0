"""The engine's half of disaggregation, two engines in one process: a prefill engine holds a
request's blocks after its first token; a decode engine loads them (here by the runners' block
copy) and decodes. Greedy tokens equal aggregated serving's with and without prefix-cache hits
on either side, when a load fails (the decode engine prefills itself; in other blocks while a
writer may still write the loaded ones) and with chunked prefill; every block comes back."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvbaton.engine import LLMEngine, SamplingParams
from kvbaton.engine.connector import EngineRequest, KvLoad
from kvbaton.engine.model_runner import ModelRunner
from kvbaton.protocols.llm import EngineOutput
from tests.engine.reference import engine, prompts, run

pytestmark = pytest.mark.unit
NEW = 10


def greedy(max_tokens: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


def prefill(
    eng: LLMEngine, rid: str, prompt: list[int], params: SamplingParams | None = None
) -> tuple[list[int], list[int]]:
    """The held request's first token and blocks."""
    eng.add_request(EngineRequest(rid, prompt, params or greedy(), hold_kv=True))
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid:
                assert out.finish_reason is None and out.kv_blocks is not None
                return out.token_ids, out.kv_blocks
    raise AssertionError("no output")


def copy_load(src: LLMEngine, dst: LLMEngine, load: KvLoad) -> None:
    """The loader: the source blocks of the load's positions, copied by id."""
    blocks = load.source
    assert isinstance(blocks, list)
    taken = blocks[load.first_block : load.first_block + len(load.dst_blocks)]
    assert isinstance(src.runner, ModelRunner) and isinstance(dst.runner, ModelRunner)
    dst.runner.write_blocks(load.dst_blocks, src.runner.read_blocks(taken))


def decode(
    dst: LLMEngine,
    src: LLMEngine,
    rid: str,
    prompt: list[int],
    first: list[int],
    blocks: list[int],
    ok: bool = True,
    params: SamplingParams | None = None,
) -> list[int]:
    """Tokens of the decode side, the prefill's first included."""
    dst.add_request(
        EngineRequest(rid, prompt, params or greedy(), kv_source=blocks, output_token_ids=first)
    )
    tokens = list(first)
    while True:
        outs = dst.step()
        for load in dst.take_kv_loads():
            if ok:
                copy_load(src, dst, load)
            dst.finish_kv_load(load.request_id, ok)
        for out in outs:
            tokens += out.token_ids
            if out.finish_reason is not None:
                return tokens


@pytest.mark.parametrize("chunked", [True, False])
def test_disaggregated_greedy_equals_aggregated(
    tiny_models: dict[str, Path], chunked: bool
) -> None:
    model_dir = tiny_models["llama-tied"]
    reference = run(engine(model_dir), prompts(), NEW)
    p_eng = engine(model_dir, enable_chunked_prefill=chunked)
    d_eng = engine(model_dir, enable_chunked_prefill=chunked)
    free = (p_eng.blocks.num_free_blocks, d_eng.blocks.num_free_blocks)
    for round_ in range(2):  # the second round hits both prefix caches
        for i, prompt in enumerate(prompts()):
            rid = f"r{round_}-{i}"
            first, blocks = prefill(p_eng, rid, prompt)
            assert len(blocks) == -(-len(prompt) // 8)
            got = decode(d_eng, p_eng, rid, prompt, first, blocks)
            assert p_eng.release_kv(rid)
            assert got == reference[i], (round_, i)
    assert p_eng.blocks.prefix_hit_rate > 0 and d_eng.blocks.prefix_hit_rate > 0
    assert (p_eng.blocks.num_free_blocks, d_eng.blocks.num_free_blocks) == free
    assert not p_eng.release_kv("r0-0")  # released once only


def test_logprobs_come_once_per_token_across_the_handoff(tiny_models: dict[str, Path]) -> None:
    """The prefill engine's answer has the first token's logprobs; the decode engine, given
    that token, emits an entry for each token it emits after it: together, aggregated
    serving's."""
    model_dir = tiny_models["llama-tied"]
    prompt = prompts()[4]
    params = SamplingParams(max_tokens=NEW, temperature=0, logprobs=2)
    outputs: dict[str, list[EngineOutput]] = {"whole": [], "prefill": [], "decode": []}
    whole, p_eng, d_eng = engine(model_dir), engine(model_dir), engine(model_dir)
    whole.add_request(EngineRequest("r", prompt, params))
    while whole.has_unfinished():
        outputs["whole"] += whole.step()
    p_eng.add_request(EngineRequest("r", prompt, params, hold_kv=True))
    while not outputs["prefill"]:
        outputs["prefill"] += p_eng.step()
    (answer,) = outputs["prefill"]
    assert answer.kv_blocks is not None
    request = EngineRequest(
        "r", prompt, params, kv_source=answer.kv_blocks, output_token_ids=answer.token_ids
    )
    d_eng.add_request(request)
    while d_eng.has_unfinished():
        outputs["decode"] += d_eng.step()
        for load in d_eng.take_kv_loads():
            copy_load(p_eng, d_eng, load)
            d_eng.finish_kv_load(load.request_id, True)
    entries = {}
    for side, outs in outputs.items():
        for out in outs:
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids), side
        entries[side] = [e for out in outs for e in out.logprobs or []]
    handed = entries["prefill"] + entries["decode"]
    assert [e[0].token_id for e in handed] == [e[0].token_id for e in entries["whole"]]
    for got, expected in zip(handed, entries["whole"], strict=True):
        assert [t.token_id for t in got] == [t.token_id for t in expected]
        assert [t.logprob for t in got] == pytest.approx([t.logprob for t in expected], abs=1e-4)
    p_eng.release_kv("r")


def test_a_failed_load_prefills_on_the_decode_side(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["llama-tied"]
    prompt = prompts()[4]
    reference = run(engine(model_dir), [prompt], NEW)[0]
    p_eng, d_eng = engine(model_dir), engine(model_dir)
    first, blocks = prefill(p_eng, "r", prompt)
    assert decode(d_eng, p_eng, "r", prompt, first, blocks, ok=False) == reference
    p_eng.release_kv("r")
    assert d_eng.blocks.num_free_blocks == d_eng.blocks.num_blocks


@pytest.mark.parametrize("aborted", [False, True])
def test_a_failed_load_a_writer_may_still_write_keeps_its_blocks_out_of_use(
    tiny_models: dict[str, Path], aborted: bool
) -> None:
    model_dir = tiny_models["llama-tied"]
    prompt = prompts()[4]
    reference = run(engine(model_dir), [prompt], NEW)[0]
    p_eng, d_eng = engine(model_dir), engine(model_dir)
    first, blocks = prefill(p_eng, "r", prompt)
    d_eng.add_request(
        EngineRequest("r", prompt, greedy(), kv_source=blocks, output_token_ids=first)
    )
    d_eng.step()
    (load,) = d_eng.take_kv_loads()
    if aborted:
        d_eng.abort_request("r")
    writes_end = threading.Event()
    d_eng.finish_kv_load("r", False, None, writes_end)
    assert isinstance(d_eng.runner, ModelRunner)
    noise = torch.randn_like(d_eng.runner.read_blocks(load.dst_blocks)) * 10
    tokens = list(first)
    while d_eng.has_unfinished():
        d_eng.runner.write_blocks(load.dst_blocks, noise)  # the late writer
        for out in d_eng.step():
            tokens += out.token_ids
    if not aborted:
        assert tokens == reference
    total = d_eng.blocks.num_blocks
    assert d_eng.blocks.num_free_blocks == total - len(load.dst_blocks)
    assert d_eng.reclaim_kv_blocks() == 0
    writes_end.set()
    assert d_eng.reclaim_kv_blocks() == len(load.dst_blocks)
    assert d_eng.blocks.num_free_blocks == total
    assert p_eng.release_kv("r")


def test_a_request_that_stops_at_its_first_token_holds_nothing(
    tiny_models: dict[str, Path],
) -> None:
    p_eng = engine(tiny_models["llama-tied"])
    p_eng.add_request(EngineRequest("one", prompts()[3], greedy(1), hold_kv=True))
    outs = []
    while p_eng.has_unfinished():
        outs += p_eng.step()
    assert outs[-1].finish_reason == "length" and outs[-1].kv_blocks is None
    assert p_eng.blocks.num_free_blocks == p_eng.blocks.num_blocks


def test_abort_while_loading_frees_blocks_once_the_load_ends(
    tiny_models: dict[str, Path],
) -> None:
    model_dir = tiny_models["llama-tied"]
    p_eng, d_eng = engine(model_dir), engine(model_dir)
    first, blocks = prefill(p_eng, "r", prompts()[5])
    d_eng.add_request(
        EngineRequest("r", prompts()[5], greedy(), kv_source=blocks, output_token_ids=first)
    )
    d_eng.step()
    (load,) = d_eng.take_kv_loads()
    final = d_eng.abort_request("r")
    assert final is not None and final.finish_reason == "abort"
    held = d_eng.blocks.num_free_blocks
    assert held < d_eng.blocks.num_blocks  # the transfer may still write them
    d_eng.finish_kv_load(load.request_id, True)
    assert d_eng.blocks.num_free_blocks == d_eng.blocks.num_blocks
    assert p_eng.release_kv("r")
    assert p_eng.blocks.num_free_blocks == p_eng.blocks.num_blocks


def test_given_output_tokens_are_checked(tiny_models: dict[str, Path]) -> None:
    eng = engine(tiny_models["llama-tied"])
    with pytest.raises(ValueError, match="fewer than max_tokens"):
        eng.add_request(EngineRequest("x", [1, 2], greedy(1), kv_source=[0], output_token_ids=[5]))
    with pytest.raises(ValueError, match="valid"):
        eng.add_request(
            EngineRequest("y", [1, 2], greedy(), kv_source=[0], output_token_ids=[10**6])
        )


def test_seeded_sampling_gives_the_same_tokens_disaggregated(tiny_models: dict[str, Path]) -> None:
    """The decode side's generator continues where the prefill side's draw left it."""
    model_dir = tiny_models["llama-tied"]
    params = SamplingParams(max_tokens=NEW, temperature=1.0, top_p=0.9, seed=7)
    prompt = prompts()[4]
    whole = engine(model_dir)
    whole.add_request(EngineRequest("w", prompt, params))
    expected: list[int] = []
    while whole.has_unfinished():
        expected += [t for out in whole.step() for t in out.token_ids]
    p_eng, d_eng = engine(model_dir), engine(model_dir)
    first, blocks = prefill(p_eng, "r", prompt, params)
    assert decode(d_eng, p_eng, "r", prompt, first, blocks, params=params) == expected


def test_a_cache_the_transfer_cannot_address_moves_through_its_host_mirror(
    tiny_models: dict[str, Path],
) -> None:
    """A GPU's cache: the agent moves blocks between host mirrors (here over shared memory),
    staged out of the prefill engine's cache and into the decode engine's. Forced on the CPU
    with `host_mirror`, so that CI runs the same calls a GPU worker makes."""
    from kvbaton.engine import EngineConfig
    from kvbaton.kv_transfer import KvPool, KvTransferAgent

    model_dir = tiny_models["llama-tied"]
    prompt = prompts()[5]
    reference = run(engine(model_dir), [prompt], NEW)[0]
    pools, engines = [], []
    for _ in range(2):
        pool = KvPool(shared=True)
        config = EngineConfig(
            model=str(model_dir), dtype="float32", block_size=8, num_kv_blocks=128
        )
        eng = LLMEngine(config, cache_buffer=pool.allocate, host_mirror=True)
        view = eng.kv_cache()
        assert view.mirrored
        pool.attach(view.buffer, view.layout, view.num_blocks, view.block_bytes)
        pools.append(pool)
        engines.append(eng)
    p_eng, d_eng = engines
    agent = KvTransferAgent(pools[1], "shm")
    try:
        first, blocks = prefill(p_eng, "r", prompt)
        assert pools[0].blocks is not None and not pools[0].blocks[blocks].any()  # not staged
        view = p_eng.kv_cache()
        layer_bytes = view.block_bytes // view.num_layers
        view.stage_out(blocks, (1, 2))  # one layer: a decode-first prompt's, as it is computed
        staged = pools[0].blocks[blocks]
        assert staged[:, layer_bytes : 2 * layer_bytes].any()
        assert not staged[:, :layer_bytes].any() and not staged[:, 2 * layer_bytes :].any()
        view.stage_out(blocks)
        d_eng.add_request(
            EngineRequest("r", prompt, greedy(), kv_source=blocks, output_token_ids=first)
        )
        tokens = list(first)
        while d_eng.has_unfinished() or d_eng.scheduler.loading:
            outs = d_eng.step()
            for load in d_eng.take_kv_loads():
                src = blocks[load.first_block : load.first_block + len(load.dst_blocks)]
                assert agent.read(pools[0].info(), src, load.dst_blocks) == "shm"
                d_eng.kv_cache().stage_in(load.dst_blocks)
                d_eng.finish_kv_load(load.request_id, True)
            tokens += [t for out in outs for t in out.token_ids]
        assert tokens == reference
    finally:
        agent.close()
        for pool in pools:
            pool.close()
