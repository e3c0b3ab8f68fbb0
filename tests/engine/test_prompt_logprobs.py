"""A prompt's logprobs (`SamplingParams.prompt_logprobs`) and ranks equal HF transformers'
log-softmax of the same model's logits at every prompt position (float32): whole and chunked
prefill, beside other requests, past a prefix the cache holds (not reused), and across a
preemption's recompute (recorded once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbaton.engine import LLMEngine, SamplingParams
from kvbaton.engine import scheduler as scheduler_module
from kvbaton.engine.connector import EngineRequest
from kvbaton.engine.sampler import PromptRows, Sampler
from kvbaton.protocols.llm import EngineOutput, TokenLogprob
from tests.engine.conftest import TEST_DEVICE
from tests.engine.reference import _hf_model, engine, prompts, run

pytestmark = pytest.mark.unit

TOP = 3


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-softmax that predicts prompt token i + 1."""
    model = _hf_model(model_dir)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt], device=TEST_DEVICE)).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def assert_matches_hf(
    got: list[list[TokenLogprob]], model_dir: Path, prompt: list[int], top: int
) -> None:
    expected = hf_prompt_logprobs(model_dir, prompt)
    assert len(got) == len(prompt) - 1
    for i, entry in enumerate(got):
        assert entry[0].token_id == prompt[i + 1]
        row, mine = expected[i], expected[i, prompt[i + 1]]
        assert entry[0].logprob == pytest.approx(float(mine), abs=1e-4)
        # its rank as vLLM counts it: how many are at least as likely
        assert int((row > mine + 1e-4).sum()) < entry[0].rank <= int((row >= mine - 1e-4).sum())
        values, ids = expected[i].topk(top)
        assert [e.token_id for e in entry[1:]] == ids.tolist()
        assert [e.logprob for e in entry[1:]] == pytest.approx(values.tolist(), abs=1e-4)


def collect(
    eng: LLMEngine, requests: dict[str, list[int]], params: SamplingParams
) -> dict[str, list[EngineOutput]]:
    outs: dict[str, list[EngineOutput]] = {rid: [] for rid in requests}
    for rid, prompt in requests.items():
        eng.add_request(EngineRequest(rid, prompt, params))
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].append(o)
    return outs


def prompt_logprobs_of(outs: list[EngineOutput]) -> list[list[TokenLogprob]]:
    """The prompt's logprobs: on the first output only."""
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert outs[0].prompt_logprobs is not None
    return outs[0].prompt_logprobs


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_prompt_logprobs_match_hf(tiny_models: dict[str, Path], chunked: bool) -> None:
    """Every prompt length of the reference set at once (one token: no entry), each chunk of
    16 tokens giving its own positions' rows."""
    model_dir = tiny_models["llama3-rope-untied"]
    budget = 16 if chunked else 256
    eng = engine(model_dir, enable_chunked_prefill=chunked, max_num_batched_tokens=budget)
    batch = {f"p{i}": p for i, p in enumerate(prompts())}
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=TOP)
    outs = collect(eng, batch, params)
    for rid, prompt in batch.items():
        assert_matches_hf(prompt_logprobs_of(outs[rid]), model_dir, prompt, TOP)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_a_one_token_chunk_of_the_prompt_gives_its_row(tiny_models: dict[str, Path]) -> None:
    """Another prompt's prefill leaves one token of the step's budget to the prompt: that
    position runs as a prefill row, and its logprobs are recorded like every other's."""
    model_dir = tiny_models["llama3-rope-untied"]
    eng = engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=5)
    prompt = prompts()[2]
    eng.add_request(EngineRequest("other", [5, 6, 7, 8], SamplingParams(max_tokens=2)))
    eng.add_request(EngineRequest("p", prompt, SamplingParams(max_tokens=2, prompt_logprobs=TOP)))
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == "p"]
    assert_matches_hf(prompt_logprobs_of(outs), model_dir, prompt, TOP)


def test_a_cached_prefix_is_computed_again(tiny_models: dict[str, Path]) -> None:
    """The prefix cache holds the prompt's first 40 tokens: a request for the prompt's
    logprobs computes them anyway (no cached tokens), and one without still hits."""
    model_dir = tiny_models["llama-tied"]
    eng = engine(model_dir)
    base = prompts()[4]  # 40 tokens: 5 full blocks of 8
    run(eng, [base])
    longer = [*base, 7, 8, 9]
    outs = collect(eng, {"logprobs": longer}, SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert outs["logprobs"][-1].usage is not None
    assert outs["logprobs"][-1].usage.cached_tokens == 0
    assert_matches_hf(prompt_logprobs_of(outs["logprobs"]), model_dir, longer, 0)
    plain = collect(eng, {"plain": longer}, SamplingParams(max_tokens=2))
    assert plain["plain"][-1].usage is not None and plain["plain"][-1].usage.cached_tokens == 40
    assert plain["plain"][0].prompt_logprobs is None


def test_a_preempted_prompt_records_its_logprobs_once(tiny_models: dict[str, Path]) -> None:
    """Too few blocks for all at once: sequences are preempted and recomputed, and each
    prompt's logprobs still come once per position, equal to HF's."""
    model_dir = tiny_models["llama-tied"]
    eng = engine(model_dir, num_kv_blocks=16, block_size=8, enable_prefix_caching=False)
    batch = {f"p{i}": p for i, p in enumerate(prompts(seed=3))}
    outs = collect(eng, batch, SamplingParams(max_tokens=30, min_tokens=30, prompt_logprobs=1))
    assert eng.scheduler.num_preemptions > 0  # the path under test was taken
    for rid, prompt in batch.items():
        assert_matches_hf(prompt_logprobs_of(outs[rid]), model_dir, prompt, 1)


def test_a_long_prompt_s_logits_come_a_bounded_chunk_at_a_time(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked prefill off and a budget that holds the prompt whole: its logits still come at
    most `PROMPT_LOGPROBS_CHUNK` rows a step (here 16), and equal HF's."""
    monkeypatch.setattr(scheduler_module, "PROMPT_LOGPROBS_CHUNK", 16)
    rows: list[int] = []
    record = Sampler.record_prompt_logprobs

    def counted(logits: torch.Tensor, spans: list[PromptRows]) -> None:
        rows.append(logits.shape[0])
        record(logits, spans)

    monkeypatch.setattr(Sampler, "record_prompt_logprobs", staticmethod(counted))
    model_dir = tiny_models["llama-tied"]
    eng = engine(model_dir, enable_chunked_prefill=False, max_num_batched_tokens=256)
    prompt = prompts()[-1]  # 75 tokens
    outs = collect(eng, {"long": prompt}, SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert_matches_hf(prompt_logprobs_of(outs["long"]), model_dir, prompt, 0)
    assert max(rows) <= 16 and sum(rows) == len(prompt) - 1


def test_prompt_logprobs_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be between 0 and 20"):
        SamplingParams(prompt_logprobs=21).validate()
