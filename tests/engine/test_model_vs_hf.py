"""Greedy outputs are token-identical to HF transformers' `generate` (same weights, float32):
one at a time and all at once, chunked prefill on and off, with prefix-cache hits and with
preemption. Then the offline face and the real SmolLM2 (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbaton.engine import LLM, SamplingParams
from kvbaton.engine import model as model_module
from kvbaton.engine.connector import EngineRequest
from tests.engine.conftest import TEST_DEVICE
from tests.engine.reference import NEW_TOKENS, engine, hf_greedy, prompts, run

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("arch", ["llama-tied", "llama3-rope-untied", "qwen2-bias"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_greedy_matches_hf_one_at_a_time_and_all_at_once(
    tiny_models: dict[str, Path], arch: str, chunked: bool
) -> None:
    model_dir = tiny_models[arch]
    expected = [hf_greedy(model_dir, tuple(p)) for p in prompts()]
    budget = 16 if chunked else 128
    eng = engine(model_dir, enable_chunked_prefill=chunked, max_num_batched_tokens=budget)
    assert [run(eng, [p])[0] for p in prompts()] == expected
    assert run(eng, prompts()) == expected


@pytest.mark.parametrize("sdpa", [True, False], ids=["sdpa", "matmuls"])
def test_both_decode_attentions_give_hfs_tokens(tiny_models: dict[str, Path], sdpa: bool) -> None:
    """Prompts of different lengths: decodes of unequal contexts in one step (the mask)."""
    model_dir = tiny_models["llama3-rope-untied"]
    expected = [hf_greedy(model_dir, tuple(p)) for p in prompts()]
    eng = engine(model_dir)
    eng.runner.model.decode_on_sdpa = sdpa
    assert run(eng, prompts()) == expected


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_decodes_taken_in_groups_give_the_same_tokens(
    tiny_models: dict[str, Path], chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group budget of one byte: every decode is gathered on its own, beside prefills too."""
    monkeypatch.setattr(model_module, "DECODE_GROUP_BYTES", 1)
    model_dir = tiny_models["llama-tied"]
    expected = [hf_greedy(model_dir, tuple(p)) for p in prompts()]
    budget = 16 if chunked else 128
    eng = engine(model_dir, enable_chunked_prefill=chunked, max_num_batched_tokens=budget)
    assert run(eng, prompts()) == expected


def test_prefix_cache_hits_give_the_same_tokens(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["llama-tied"]
    eng = engine(model_dir)
    base = prompts()[4]  # 40 tokens: 5 full blocks of 8
    run(eng, [base])
    longer = [*base, 7, 8, 9, 10, 11]
    eng.add_request(
        EngineRequest("hit", longer, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    )
    got: list[int] = []
    cached = 0
    while eng.has_unfinished():
        for o in eng.step():
            got += o.token_ids
            if o.usage:
                cached = o.usage.cached_tokens
    assert cached == 40
    assert got == hf_greedy(model_dir, tuple(longer))
    assert eng.stats().prefix_cache_hit_rate > 0


def test_preemption_by_recompute_gives_the_same_tokens(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["llama-tied"]
    batch = prompts(seed=3)
    expected = [hf_greedy(model_dir, tuple(p), 30) for p in batch]
    eng = engine(model_dir, num_kv_blocks=16, block_size=8, enable_prefix_caching=False)
    assert run(eng, batch, new_tokens=30) == expected
    assert eng.scheduler.num_preemptions > 0  # the path under test was taken


def test_seeded_sampling_is_reproducible_whatever_the_batch(
    tiny_models: dict[str, Path],
) -> None:
    model_dir = tiny_models["llama-tied"]
    eng = engine(model_dir)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=20, seed=1234)

    def sample(with_others: int) -> list[int]:
        rid = f"seeded-{with_others}"
        eng.add_request(EngineRequest(rid, prompts()[2], params))
        for i in range(with_others):
            eng.add_request(
                EngineRequest(
                    f"other-{with_others}-{i}",
                    prompts()[i % 6],
                    SamplingParams(max_tokens=8, temperature=1.0),
                ),
            )
        got: list[int] = []
        while eng.has_unfinished():
            got += [t for o in eng.step() if o.request_id == rid for t in o.token_ids]
        return got

    alone = sample(0)
    assert sample(5) == alone and sample(2) == alone
    assert len(alone) == 10


def test_abort_frees_blocks_at_once(tiny_models: dict[str, Path]) -> None:
    eng = engine(tiny_models["llama-tied"])
    eng.add_request(EngineRequest("a", prompts()[5], SamplingParams(max_tokens=50, temperature=0)))
    eng.step()
    assert eng.blocks.num_free_blocks < eng.blocks.num_blocks
    final = eng.abort_request("a")
    assert final is not None and final.finish_reason == "abort"
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert not eng.has_unfinished()


def test_bad_requests_are_refused_clearly(tiny_models: dict[str, Path]) -> None:
    eng = engine(tiny_models["llama-tied"], max_model_len=64, num_kv_blocks=4)
    ok = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request(EngineRequest("x", [], ok))
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request(EngineRequest("x", [1, 5000], ok))
    with pytest.raises(ValueError, match="context"):
        eng.add_request(EngineRequest("x", [5] * 64, ok))
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request(EngineRequest("x", [5] * 30, SamplingParams(max_tokens=30)))
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request(EngineRequest("x", [5], SamplingParams(temperature=-1)))
    eng.add_request(EngineRequest("dup", [5], ok))
    with pytest.raises(ValueError, match="already"):
        eng.add_request(EngineRequest("dup", [5], ok))


def test_offline_face_generates_and_chats(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["llama-tied"]
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        device=TEST_DEVICE,
        num_kv_blocks=64,
        block_size=8,
    )
    outs = llm.generate(["w1 w2 w3", "w4"], SamplingParams(max_tokens=5, temperature=0))
    assert [o.token_ids for o in outs] == [
        hf_greedy(model_dir, tuple(llm.tokenizer.encode(t)), 5) for t in ["w1 w2 w3", "w4"]
    ]
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids)
    assert outs[0].finish_reason == "length"
    chat = llm.chat(
        [{"role": "user", "content": "w5 w6"}],
        SamplingParams(max_tokens=3, temperature=0, logprobs=2),
    )
    assert len(chat[0].token_ids) == 3
    assert chat[0].logprobs is not None and len(chat[0].logprobs) == 3
    assert all(len(entry) == 3 for entry in chat[0].logprobs)


def test_blocks_move_between_caches_by_id(tiny_models: dict[str, Path]) -> None:
    """Blocks read out by id from one engine's cache and written by id into another's arrive
    intact, each block one contiguous piece across all layers: the layout that the
    disaggregation issue builds on."""
    from kvbaton.engine.sequence import Sequence

    model_dir = tiny_models["llama-tied"]
    first, second = engine(model_dir), engine(model_dir)
    prompt = prompts()[4]  # 40 tokens: 5 full blocks of 8
    run(first, [prompt])
    source = first.blocks.match_prefix(Sequence("probe", [*prompt, 1], SamplingParams()))
    assert len(source) == 5
    data = first.runner.read_blocks(source)
    assert data.shape == (5, *first.runner.cache.shape[1:])  # type: ignore[union-attr]
    assert all(first.runner.cache[b].is_contiguous() for b in source)  # type: ignore[index]
    assert data.abs().sum() > 0  # the prefill's KV, not empty blocks
    target = [7, 3, 11, 0, 5]
    second.runner.write_blocks(target, data)
    assert torch.equal(second.runner.read_blocks(target), data)


def test_a_failed_step_leaves_no_prefix_that_was_never_computed(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks are registered when scheduled; if the forward pass then fails, none of them may
    be served as a prefix hit later."""
    eng = engine(tiny_models["llama-tied"])
    eng.add_request(
        EngineRequest("doomed", prompts()[4], SamplingParams(max_tokens=4, temperature=0))
    )

    def broken(output: object) -> dict[str, int]:
        raise RuntimeError("device fell over")

    monkeypatch.setattr(eng.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="fell over"):
        eng.step()
    assert eng.blocks.stats().cached == 0
    monkeypatch.undo()
    eng.abort_request("doomed")
    assert run(eng, [prompts()[4]]) == [hf_greedy(tiny_models["llama-tied"], tuple(prompts()[4]))]
