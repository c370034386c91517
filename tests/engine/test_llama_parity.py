"""Kestrel's Llama against transformers' LlamaForCausalLM on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import loader

from model_factory import make_tiny_llama

ROPE_VARIANTS = {
    "default": {},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "yarn": {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "rope_theta": 500000.0,
    },
}
SHAPES = {
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "mqa-bias": dict(num_attention_heads=4, num_key_value_heads=1, attention_bias=True),
}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _prompt(n: int, vocab: int = 384, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("rope", list(ROPE_VARIANTS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp32_logits_match_transformers(tmp_path: Path, rope: str, shape: str, device: str):
    overrides = {**SHAPES[shape], **ROPE_VARIANTS[rope]}
    hf = make_tiny_llama(tmp_path, **overrides)
    ids = _prompt(150)  # crosses yarn's/llama3's original context of 64
    ref = hf(torch.tensor([ids])).logits[0]
    # small pages and prefill chunks: the paged cache and chunking are part of the check
    m = loader.load(
        tmp_path, "kestrel", device=device, dtype="float32", page_size=16, prefill_chunk=48
    )
    ours = m.logits(ids)
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert _rel_err(ours, ref) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_logits_match_transformers(tmp_path: Path, dtype: torch.dtype, device: str):
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("CPU fp16 matmuls are emulated and slow; checked on the GPU")
    hf = make_tiny_llama(tmp_path, dtype=dtype)
    ids = _prompt(100)
    ref = hf.to(dtype).to(device)(torch.tensor([ids], device=device)).logits[0].float().cpu()
    m = loader.load(tmp_path, "kestrel", device=device, dtype=str(dtype).split(".")[1])
    # Same weights in the same dtype; only the order of roundings differs.
    assert _rel_err(m.logits(ids), ref) < 3e-2


@pytest.mark.parametrize("shape", ["gqa-untied", "mha-tied"])
def test_greedy_64_tokens_identical(tmp_path: Path, shape: str, device: str):
    hf = make_tiny_llama(tmp_path, **SHAPES[shape])
    ids = _prompt(20, seed=7)
    ref = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=64,
        min_new_tokens=64,
        pad_token_id=0,
    )[0, len(ids) :].tolist()
    m = loader.load(tmp_path, "kestrel", device=device, dtype="float32", page_size=16)
    settings = {"max_new_tokens": 64, "temperature": 0, "ban_eos_token": True}
    ours = [t for chunk in m.stream(ids, settings) for t in chunk.token_ids]
    assert ours == ref


def test_transformers_loader_streams_same_tokens(tmp_path: Path):
    make_tiny_llama(tmp_path)
    ids = _prompt(12, seed=3)
    settings = {"max_new_tokens": 24, "temperature": 0, "ban_eos_token": True}
    a = loader.load(tmp_path, "kestrel", device="cpu", dtype="float32")
    b = loader.load(tmp_path, "transformers", device="cpu", dtype="float32")
    ta = [t for c in a.stream(ids, settings) for t in c.token_ids]
    tb = [t for c in b.stream(ids, settings) for t in c.token_ids]
    assert ta == tb and len(ta) == 24
    assert _rel_err(a.logits(ids), b.logits(ids)) < 1e-4
