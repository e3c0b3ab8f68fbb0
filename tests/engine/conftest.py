"""Tiny random-weight models of the supported architectures, built once per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

VOCAB = 96
WORDS = [f"w{i}" for i in range(VOCAB - 4)]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant{% endif %}"
)

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama-tied": {"model_type": "llama", "tie_word_embeddings": True},
    "llama3-rope-untied": {
        "model_type": "llama",
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2-bias": {"model_type": "qwen2", "tie_word_embeddings": True},
}


def build_tiny_model(path: Path, arch: str, seed: int = 0) -> Path:
    """Save a random Llama-family model (and a word-level tokenizer) under `path`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    spec = dict(ARCHITECTURES[arch])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.25,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
        **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.save_pretrained(path)

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3} | {w: i + 4 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(root / arch, arch) for arch in ARCHITECTURES}
