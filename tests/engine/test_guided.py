"""Guided decoding: a constrained request's output follows its constraint by construction, on a
random-weight model; the constraint also holds for tokens sampled elsewhere, replayed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from kvbaton.engine import EngineConfig, LLMEngine
from kvbaton.engine.connector import EngineRequest
from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.protocols.llm import Guided, SamplingParams
from tests.engine.conftest import TEST_DEVICE
from tests.helpers import fresh_interpreter
from tests.tiny_models import build_chat_model

pytestmark = pytest.mark.unit

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")


def generate(model_dir: Path, guided: Guided, seeds: range, **params: object) -> list[str]:
    """One request per seed, all in one batch, with the constraint; their texts."""
    eng = LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", device=TEST_DEVICE, num_kv_blocks=256)
    )
    outputs: dict[str, list[int]] = {}
    for seed in seeds:
        sampling = SamplingParams(max_tokens=120, seed=seed, guided=guided, **params)  # type: ignore[arg-type]
        eng.add_request(EngineRequest(f"r{seed}", [5, 6, 7, seed + 8], sampling))
        outputs[f"r{seed}"] = []
    finished: dict[str, str | None] = {}
    while eng.has_unfinished():
        for out in eng.step():
            outputs[out.request_id] += out.token_ids
            if out.finish_reason:
                finished[out.request_id] = out.finish_reason
    assert set(finished.values()) == {"stop"}, finished  # each ended by the grammar, not cut
    tokenizer = Tokenizer(model_dir)
    eos = eng.eos_token_ids
    return [tokenizer.decode([t for t in tokens if t not in eos]) for tokens in outputs.values()]


def test_a_json_schema_holds_for_every_sampled_answer(model_dir: Path) -> None:
    guided = Guided(kind="json", spec=json.dumps(SCHEMA))
    for text in generate(model_dir, guided, range(8), temperature=1.0):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_regex_and_a_choice_hold(model_dir: Path) -> None:
    for text in generate(model_dir, Guided(kind="regex", spec=r"[a-c]{2,5}-\d{3}"), range(4)):
        assert re.fullmatch(r"[a-c]{2,5}-\d{3}", text), text
    choices = ["north", "south", "east by east"]
    for text in generate(model_dir, Guided(kind="choice", spec=json.dumps(choices)), range(4)):
        assert text in choices


def test_tokens_sampled_elsewhere_are_replayed_through_the_grammar(model_dir: Path) -> None:
    tokenizer = Tokenizer(model_dir)
    guided = Guided(kind="regex", spec=r"ab[0-9]{4}")
    eng = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64))
    first = tokenizer.encode("ab")
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3, guided=guided)
    eng.add_request(EngineRequest("r", [5, 6, 7], params, output_token_ids=first))
    tokens: list[int] = list(first)
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.token_ids
    text = tokenizer.decode([t for t in tokens if t not in eng.eos_token_ids])
    assert re.fullmatch(r"ab[0-9]{4}", text), text
    with pytest.raises(ValueError, match="breaks the constraint"):
        broken = tokenizer.encode("zz")
        eng.add_request(EngineRequest("x", [5, 6], params, output_token_ids=broken))


def test_a_migrated_requests_tokens_are_replayed_from_its_prompt(model_dir: Path) -> None:
    """Migration moves the tokens generated so far into the prompt (`Guided.replay` of them):
    the new worker's matcher goes through them before it samples."""
    tokenizer = Tokenizer(model_dir)
    eng = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64))
    done = tokenizer.encode("ab12")
    guided = Guided(kind="regex", spec=r"ab[0-9]{4}", replay=len(done))
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=5, guided=guided)
    eng.add_request(EngineRequest("r", [5, 6, 7, *done], params))
    tokens: list[int] = []
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.token_ids
    rest = tokenizer.decode([t for t in tokens if t not in eng.eos_token_ids])
    assert re.fullmatch(r"[0-9]{2}", rest), rest
    too_many = Guided(kind="regex", spec="a+", replay=9)
    with pytest.raises(ValueError, match="replays more tokens"):
        eng.add_request(EngineRequest("x", [5, 6], SamplingParams(guided=too_many)))


@pytest.mark.parametrize(
    ("guided", "extra", "match"),
    [
        (Guided(kind="json", spec='{"type": "nonsense"}'), {}, "json constraint is invalid"),
        (Guided(kind="regex", spec="(unclosed"), {}, "regex constraint is invalid"),
        (Guided(kind="xml", spec="<a/>"), {}, "guided kind"),
        (Guided(kind="regex", spec="a+"), {"ignore_eos": True}, "ignore_eos"),
        (Guided(kind="regex", spec="a+"), {"min_tokens": 2}, "min_tokens"),
    ],
)
def test_a_bad_constraint_is_refused(
    model_dir: Path, guided: Guided, extra: dict[str, object], match: str
) -> None:
    eng = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64))
    params = SamplingParams(max_tokens=8, guided=guided, **extra)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        eng.add_request(EngineRequest("r", [5, 6, 7], params))


def test_a_token_the_grammar_refuses_aborts_that_request_only(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault that lets a constrained row sample outside its mask (here: no mask at all) ends
    that request with "abort"; the rest of the batch goes on."""
    from kvbaton.engine.guided import GuidedDecoding

    monkeypatch.setattr(GuidedDecoding, "mask", lambda self, logits, rows: None)
    eng = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64))
    never = Guided(kind="regex", spec="\x01{3}")  # no sampled token writes a control character
    eng.add_request(EngineRequest("bad", [5, 6, 7], SamplingParams(max_tokens=8, guided=never)))
    eng.add_request(EngineRequest("good", [5, 6, 8], SamplingParams(max_tokens=8, ignore_eos=True)))
    finished: dict[str, str | None] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finish_reason:
                finished[out.request_id] = out.finish_reason
    assert finished == {"bad": "abort", "good": "length"}
    assert eng.stats().kv_blocks_used == 0  # the aborted request's blocks freed too


ENGINE_THEN_CONSTRAINT = """
import json, sys
import torch
from kvbaton.engine import EngineConfig, LLMEngine
from kvbaton.protocols.llm import Guided

engine = LLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", num_kv_blocks=64))
started = sorted(m for m in ("llguidance.torch", "torch._dynamo") if m in sys.modules)
from torch._dynamo.utils import counters
guided = engine.runner.guided
constraint = Guided(kind="regex", spec="[ab]+")
guided.compile(constraint)
graphs = counters["stats"]["unique_graphs"]
guided.mask(torch.zeros(3, guided.vocab_size), [(1, guided.matcher(constraint, []))])
print(json.dumps([started, graphs, counters["stats"]["unique_graphs"]]))
"""


def test_the_mask_kernel_compiles_at_the_first_constraint_not_at_start(model_dir: Path) -> None:
    """An engine starts without llguidance's compiled kernel (seconds of start-up); the first
    constraint's `compile` (off the step loop) builds it, so the step's first mask does not."""
    started, compiled, after_mask = fresh_interpreter(ENGINE_THEN_CONSTRAINT, str(model_dir))
    assert started == [], "an engine with no constraint yet imported torch's compiler"
    assert compiled > 0 and after_mask == compiled
