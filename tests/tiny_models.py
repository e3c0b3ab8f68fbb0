"""Tiny random-weight models of the supported architectures, with a word-level tokenizer (for the
engine's tests) or a byte-level BPE one with a ChatML template (for the frontend's tests)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _save_model(path, arch, seed, VOCAB, bos=1, eos=None)
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


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ChatML whose answer opens inside the reasoning, as DeepSeek-R1's does, unless the thinking
# is switched off (`enable_thinking` false): then the prompt closes it, as Qwen3's does.
THINKING_TEMPLATE = CHATML_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n<think>\n{% if enable_thinking is false %}\n</think>\n\n{% endif %}"
    "{% endif %}",
)
# ChatML that takes tools as Hermes-style templates do (Qwen 2.5's, shortened): the tools'
# names in a system message, the history's calls in <tool_call> tags, results as a tool turn.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Héllo wörld! Grüße aus Köln. 日本語のテキスト。 Emoji: 🙂🚀",
    "def add(a, b):\n    return a + b  # numbers 0123456789",
    "Once upon a time, a small model answered every question with random words.",
]


def build_chat_model(
    path: Path,
    arch: str = "llama-tied",
    seed: int = 0,
    template: str | None = None,
    max_positions: int = 256,
    added_tokens: Sequence[str] = (),
) -> Path:
    """Save a random model with a byte-level BPE tokenizer (every string encodes; characters
    split across tokens) and a ChatML template whose end token is the model's EOS (`template`:
    another one), of `max_positions` positions. `added_tokens`: strings that are one token each
    (not special: decoded as text, as a reasoning model's `<think>`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.add_tokens(list(added_tokens))
    fast.chat_template = template or CHATML_TEMPLATE
    fast.save_pretrained(path)
    _save_model(
        path, arch, seed, len(fast), bos=None, eos=fast.eos_token_id, positions=max_positions
    )
    return path


def _save_model(
    path: Path,
    arch: str,
    seed: int,
    vocab: int,
    bos: int | None,
    eos: int | None,
    positions: int = 256,
) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCHITECTURES[arch])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        initializer_range=0.25,
        rms_norm_eps=1e-6,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=0,
        **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.save_pretrained(path)
