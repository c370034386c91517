"""Kestrel's Llama against transformers' LlamaForCausalLM on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import loader
from helpers.model_factory import make_tiny_llama
from helpers.parity import ROPE_VARIANTS, SHAPES, prompt_ids, rel_err


@pytest.mark.parametrize("rope", list(ROPE_VARIANTS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp32_logits_match_transformers(tmp_path: Path, rope: str, shape: str, device: str):
    overrides = {**SHAPES[shape], **ROPE_VARIANTS[rope]}
    hf = make_tiny_llama(tmp_path, **overrides)
    ids = prompt_ids(150)  # crosses yarn's/llama3's original context of 64
    ref = hf(torch.tensor([ids])).logits[0]
    # small pages and prefill chunks: the paged cache and chunking are part of the check
    m = loader.load(
        tmp_path, "kestrel", device=device, dtype="float32", page_size=16, prefill_chunk=48
    )
    ours = m.logits(ids)
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert rel_err(ours, ref) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_logits_match_transformers(tmp_path: Path, dtype: torch.dtype, device: str):
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("CPU fp16 matmuls are emulated and slow; checked on the GPU")
    hf = make_tiny_llama(tmp_path, dtype=dtype)
    ids = prompt_ids(100)
    ref = hf.to(dtype).to(device)(torch.tensor([ids], device=device)).logits[0].float().cpu()
    m = loader.load(tmp_path, "kestrel", device=device, dtype=str(dtype).split(".")[1])
    # Same weights in the same dtype; only the order of roundings differs.
    assert rel_err(m.logits(ids), ref) < 3e-2


@pytest.mark.parametrize("shape", ["gqa-untied", "mha-tied"])
def test_greedy_64_tokens_identical(tmp_path: Path, shape: str, device: str):
    hf = make_tiny_llama(tmp_path, **SHAPES[shape])
    ids = prompt_ids(20, seed=7)
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
    ids = prompt_ids(12, seed=3)
    settings = {"max_new_tokens": 24, "temperature": 0, "ban_eos_token": True}
    a = loader.load(tmp_path, "kestrel", device="cpu", dtype="float32")
    b = loader.load(tmp_path, "transformers", device="cpu", dtype="float32")
    ta = [t for c in a.stream(ids, settings) for t in c.token_ids]
    tb = [t for c in b.stream(ids, settings) for t in c.token_ids]
    assert ta == tb and len(ta) == 24
    assert rel_err(a.logits(ids), b.logits(ids)) < 1e-4
