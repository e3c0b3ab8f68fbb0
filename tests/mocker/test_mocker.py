"""The mocker: the engine's scheduler and block manager with a timing model in place of the
model. The runner takes no time (it adds up the modeled time), so nothing here waits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvbaton.engine.config import MOCKER_DEFAULTS
from kvbaton.engine.connector import EngineRequest
from kvbaton.mocker import MockerTiming
from kvbaton.mocker.runner import mocker_config
from kvbaton.mocker.timing import parse_coefficients
from kvbaton.protocols.kv import BlockStored
from kvbaton.protocols.llm import SamplingParams
from tests.mocker.stepped import Mocker

pytestmark = pytest.mark.unit


def test_timing_defaults_are_dynamos() -> None:
    t = MockerTiming()
    assert t.prefill_ms(1000) == pytest.approx(4.21e-7 * 1e6 + 15.18 + 16.5)
    assert t.decode_ms(0.5) == pytest.approx(-25.74 / 4 + 54.01 / 2 + 5.74)
    assert t.decode_ms(5.0) == 1.0  # floored at 1 ms
    both = t.prefill_ms(100) + t.decode_ms(0.25)
    assert t.step_seconds(100, 3, 0.25) == pytest.approx(both / 1000)
    assert t.step_seconds(0, 0, 0.9) == 0.0
    assert MockerTiming(speedup_ratio=10).step_seconds(100, 0, 0) == pytest.approx(
        t.prefill_ms(100) / 10_000
    )
    assert mocker_config().block_size == MOCKER_DEFAULTS["block_size"] == 64


def test_bad_timing_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="speedup_ratio"):
        MockerTiming(speedup_ratio=0)
    with pytest.raises(ValueError, match="three"):
        parse_coefficients("1,2")
    assert parse_coefficients("1,2.5,-3") == (1.0, 2.5, -3.0)


def test_outputs_are_deterministic_never_special_and_run_to_max_tokens(
    mocker_model: Path,
) -> None:
    params = SamplingParams(max_tokens=12)
    prompts = {"a": list(range(30, 40)), "b": list(range(50, 63))}
    first = Mocker(mocker_model).run(prompts, params)
    alone = Mocker(mocker_model).run({"b": prompts["b"]}, params)
    assert first["b"] == alone["b"]  # whatever the batch
    assert first["a"] != first["b"]
    config = json.loads((mocker_model / "config.json").read_text())
    added = json.loads((mocker_model / "tokenizer.json").read_text())["added_tokens"]
    never = {t["id"] for t in added} | {config["eos_token_id"]}
    for tokens in first.values():
        assert len(tokens) == 12
        assert not never & set(tokens)
        assert all(0 <= t < config["vocab_size"] for t in tokens)
    seeded = Mocker(mocker_model).run({"a": prompts["a"]}, SamplingParams(max_tokens=12, seed=7))
    assert seeded["a"] != first["a"]  # the seed is part of what decides


def test_logprobs_come_from_a_mocked_distribution(mocker_model: Path) -> None:
    prompt = list(range(30, 40))
    params = SamplingParams(max_tokens=6, logprobs=2, prompt_logprobs=1)
    mocker = Mocker(mocker_model)
    tokens = mocker.run({"a": prompt}, params)["a"]
    outputs = mocker.outputs["a"]
    entries = [entry for out in outputs for entry in out.logprobs or []]
    # One entry per output token: the token, then the two likeliest (the token first).
    assert [chosen.token_id for chosen, *_ in entries] == tokens
    for chosen, *best in entries:
        assert [t.token_id for t in best][:1] == [chosen.token_id]
        assert [t.logprob for t in best] == [chosen.logprob, 2 * chosen.logprob]
        assert chosen.logprob == pytest.approx(math.log(0.5))
    # One per prompt token after the first, ranked first, on the request's first output.
    prompt_entries = outputs[0].prompt_logprobs
    assert prompt_entries is not None
    assert [(e[0].token_id, e[0].rank, len(e)) for e in prompt_entries] == [
        (t, 1, 2) for t in prompt[1:]
    ]
    assert all(out.prompt_logprobs is None for out in outputs[1:])
    # Chunked prefills and a preemption's recompute (too few blocks for both): each prompt's
    # entries come once, each output token's once.
    prompts = {"a": prompt, "b": list(range(50, 63))}
    tight = Mocker(mocker_model, max_num_batched_tokens=4, num_kv_blocks=6)
    answers = tight.run(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    for rid, answer in answers.items():
        outs = tight.outputs[rid]
        assert [e[0].token_id for out in outs for e in out.logprobs or []] == answer
        assert [e[0].token_id for e in outs[0].prompt_logprobs or []] == prompts[rid][1:]
    # Asked for nothing, none come.
    plain = Mocker(mocker_model)
    assert plain.run({"a": prompt}, SamplingParams(max_tokens=6))["a"] == tokens
    assert all(not out.logprobs and out.prompt_logprobs is None for out in plain.outputs["a"])


def test_step_time_follows_the_model(mocker_model: Path) -> None:
    mocker = Mocker(mocker_model)
    mocker.run({"a": list(range(30, 50))}, SamplingParams(max_tokens=3))
    timing = MockerTiming()
    # One prefill step of 20 tokens, then two decode steps (KV use: 6 of 32 blocks).
    assert mocker.sleeps[0] == pytest.approx(timing.prefill_ms(20) / 1000)
    assert mocker.sleeps[1:] == pytest.approx([timing.decode_ms(6 / 32) / 1000] * 2)


def test_prefix_hits_events_and_blocks_come_back(mocker_model: Path) -> None:
    mocker = Mocker(mocker_model)
    free = mocker.engine.blocks.num_free_blocks
    prompt = list(range(30, 47))  # 4 full blocks of 4, and one token
    mocker.run({"a": prompt}, SamplingParams(max_tokens=4))
    mocker.run({"b": prompt}, SamplingParams(max_tokens=4))
    usage = mocker.finals["b"].usage
    assert usage is not None and usage.cached_tokens == 16
    stored = [e for e in mocker.events if isinstance(e, BlockStored)]
    assert stored[0].block_hashes == mocker.engine.kv_dump().block_hashes[:4]
    assert [e.event_id for e in mocker.events] == list(range(len(mocker.events)))
    assert mocker.engine.blocks.num_free_blocks == free
    stats = mocker.engine.stats()
    assert (stats.active_prefill_tokens, stats.kv_blocks_used) == (0, 0)


def test_load_counts_prefill_and_decode(mocker_model: Path) -> None:
    mocker = Mocker(mocker_model, max_num_batched_tokens=8)
    mocker.engine.add_request(EngineRequest("a", list(range(30, 50)), SamplingParams(max_tokens=4)))
    assert mocker.engine.stats().active_prefill_tokens == 20
    mocker.engine.step()  # 8 of its 20 prompt tokens
    assert mocker.engine.stats().active_prefill_tokens == 12
    mocker.engine.step()
    mocker.engine.step()  # the prompt is done: it decodes
    stats = mocker.engine.stats()
    assert stats.active_prefill_tokens == 0
    assert stats.kv_blocks_used == 5  # 20 computed tokens in blocks of 4
    mocker.engine.add_request(EngineRequest("b", list(range(30, 50)), SamplingParams(max_tokens=4)))
    # Waiting, it counts only what the prefix cache will not give it: a's 4 full blocks are
    # there, and the last token is always computed (a router that read 20 would send b's
    # like elsewhere, to a worker without its prefix).
    assert mocker.engine.stats().active_prefill_tokens == 20 - 16
    mocker.engine.step()  # b finds a's 4 full blocks in the cache and shares them
    assert mocker.engine.stats().kv_blocks_used == 5 + 2  # a's tail grew; b's own tail


def test_a_request_resent_with_its_outputs_in_its_prompt_goes_on_with_the_same_tokens(
    mocker_model: Path,
) -> None:
    """What migration relies on: the outputs so far, appended to the prompt, lead to the same
    next tokens (and a disaggregated decode worker, given the first token, to the same rest)."""
    prompt = list(range(30, 45))
    whole = Mocker(mocker_model).run({"r": prompt}, SamplingParams(max_tokens=12, seed=7))["r"]
    resent = Mocker(mocker_model).run(
        {"r": prompt + whole[:5]}, SamplingParams(max_tokens=7, seed=7)
    )["r"]
    assert resent == whole[5:]
    other_seed = Mocker(mocker_model).run({"r": prompt}, SamplingParams(max_tokens=12, seed=8))
    assert other_seed["r"] != whole
    engine = Mocker(mocker_model).engine
    engine.add_request(
        EngineRequest(
            "d", prompt, SamplingParams(max_tokens=12, seed=7), output_token_ids=whole[:1]
        )
    )
    rest: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            rest += out.token_ids
    assert rest == whole[1:]
