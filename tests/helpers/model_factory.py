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


def randomize_weights(model: torch.nn.Module) -> None:
    """Norms near 1, other weights N(0, 0.08). The default init gives near-uniform logits;
    larger weights make argmax ties unlikely, so greedy comparisons test something."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.08)


def make_tiny_llama(path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """Save a random-weight LlamaForCausalLM (and tokenizer) to `path`; returns the HF model
    in float32 on the CPU, in eval mode with the eager attention for exact reference math."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(**overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    randomize_weights(model)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return model.float().eval()


TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=1,
)


def make_tiny_model(
    path: Path,
    config_cls: Any,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    save_original_format: bool = True,
    **overrides: Any,
):
    """Save a random-weight causal LM of any architecture (and a tokenizer) to `path`.

    `config_cls` is a transformers config class (Qwen2Config, Gemma2Config, ...); the model
    class comes from AutoModelForCausalLM. Returns the HF model in float32 on the CPU, in
    eval mode with the eager attention (soft-capping and sliding windows need it).
    `save_original_format=False` writes transformers 5's internal layout (fused MoE experts).
    """
    from transformers import AutoModelForCausalLM

    config = config_cls(**{**TINY_SHAPE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # Gemma stores norms as w - 1 (it multiplies by 1 + w), so its "one" is zero.
    norm_center = 0.0 if "gemma" in config.model_type else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(norm_center - 0.2, norm_center + 0.2)
            else:
                p.normal_(0, 0.08)
    # Passed only when asked for: older transformers 5 releases may not know the keyword.
    layout = {} if save_original_format else {"save_original_format": False}
    model.to(dtype).save_pretrained(path, safe_serialization=True, **layout)
    write_tokenizer(path)
    return model.float().eval()


def make_scripted_llama(path: Path, script: list[str], chat_template: str) -> list[str]:
    """Save a real LlamaForCausalLM whose greedy reply to any prompt that ends in
    `script[0]` is the words `script[1:]`, then EOS. Returns its vocabulary.

    The tokenizer is word-level on whitespace (unknown words are <unk>); the embeddings are
    one-hot, every attention and MLP output projection is zero, so the last hidden state is
    the current word's embedding, and the head maps each script word to the next one. The
    words decode joined by single spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM

    vocab = ["<unk>", "<s>", "</s>", *dict.fromkeys(script)]
    if len(vocab) != 3 + len(script):
        raise ValueError("script words must be distinct (each has one successor)")
    ids = {word: i for i, word in enumerate(vocab)}
    size = max(64, len(vocab))
    config = tiny_llama_config(
        vocab_size=len(vocab), hidden_size=size, intermediate_size=size, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if "norm" in name else 0.0)
        model.model.embed_tokens.weight[:, : len(vocab)] = torch.eye(len(vocab))
        for word, following in zip(script, [*script[1:], "</s>"], strict=True):
            model.lm_head.weight[ids[following], ids[word]] = 1.0
    model.save_pretrained(path, safe_serialization=True)
    tokenizer = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": False,
                "chat_template": chat_template,
            }
        ),
        encoding="utf-8",
    )
    return vocab
