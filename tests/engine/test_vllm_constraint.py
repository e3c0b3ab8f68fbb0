"""kvbaton's logits processor in vLLM's engine core: a migrated request's constraint resumes past
the tokens another worker generated (no engine started). Runs where vLLM is installed
(scripts/vllm_env.sh); skipped elsewhere."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import msgspec
import pytest
import torch
import transformers

from kvbaton.engine.vllm_params import REPLAYED_CONSTRAINT, RESUMED_CONSTRAINTS
from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.protocols.llm import Guided
from tests.helpers import NEEDS_VLLM
from tests.tiny_models import build_chat_model

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.unit,
    NEEDS_VLLM,
]

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "pets": {"type": "integer"}},
    "required": ["name", "pets"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")


def processor(model_dir: Path) -> Any:
    """vLLM's engine core's instance, from the name the worker gives vLLM."""
    module, name = RESUMED_CONSTRAINTS.split(":")
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    model_config = SimpleNamespace(
        tokenizer=str(model_dir), hf_config=hf_config, get_vocab_size=lambda: hf_config.vocab_size
    )
    cls = getattr(importlib.import_module(module), name)
    return cls(SimpleNamespace(model_config=model_config), torch.device("cpu"), False)


def test_a_constraint_resumes_past_the_replayed_tokens(model_dir: Path) -> None:
    from vllm import SamplingParams

    tokenizer = Tokenizer(model_dir)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    # Generated under the constraint by another worker:
    replayed = tokenizer.encode('{"name":"Al', add_special_tokens=False)
    guided = Guided(kind="json", spec=json.dumps(SCHEMA), replay=len(replayed))
    params = SamplingParams(extra_args={REPLAYED_CONSTRAINT: msgspec.structs.asdict(guided)})
    resumed = processor(model_dir).new_req_logits_processor(params)
    prompt, output = [5, 6, *replayed], list[int]()
    generator = torch.Generator().manual_seed(0)
    while len(output) < 80:
        logits = resumed(prompt, output, torch.randn(config.vocab_size, generator=generator))
        output.append(int(logits.argmax()))  # random logits: only the mask keeps it valid
        if output[-1] == config.eos_token_id:
            break
    assert output[-1] == config.eos_token_id
    text = tokenizer.decode(replayed + output[:-1])
    assert text.startswith('{"name":"Al')
    jsonschema.validate(json.loads(text), SCHEMA)


def test_requests_without_a_replayed_constraint_are_not_tracked(model_dir: Path) -> None:
    from vllm import SamplingParams

    assert processor(model_dir).new_req_logits_processor(SamplingParams()) is None


def test_a_cpu_worker_loads_it_unless_it_decodes_speculatively(model_dir: Path) -> None:
    from kvbaton.engine.vllm_engine import engine_args

    assert RESUMED_CONSTRAINTS in engine_args(model_dir, {}, []).logits_processors
    speculative = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    assert not engine_args(model_dir, {}, speculative).logits_processors  # vLLM refuses both
