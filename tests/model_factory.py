"""Tiny real checkpoints for tests: random weights saved by transformers itself, with a
byte-level BPE tokenizer trained on the spot, so no test needs the network."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Kestrels hover over fields.",
    "Once upon a time, in a small village, there lived a curious girl named Ada.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Café, naïve, 中文字符, emoji 🦅 and more text for byte-level merges.",
] * 20


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(path: Path) -> int:
    """Writes tokenizer files into `path`; returns the vocabulary size."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            }
        ),
        encoding="utf-8",
    )
    return json.loads(_tokenizer_json())["model"]["vocab"].__len__()


def tiny_llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    values: dict[str, Any] = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def make_tiny_llama(path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """Save a random-weight LlamaForCausalLM (and tokenizer) to `path`; returns the HF model
    in float32 on the CPU, in eval mode with the eager attention for exact reference math."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(**overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Default init gives near-uniform logits; larger weights make argmax ties unlikely, so
    # greedy comparisons test something.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.08)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return model.float().eval()
