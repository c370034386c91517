"""kernels.attention.prompt_attention (a fresh prompt's causal attention through torch SDPA)
against the paged attention reference on the same keys, the rules for when it applies, and
the engine's use of it: `ForwardBatch.fresh` marks exactly the single-sequence forwards that
start a sequence, and a fresh prefill gives the paged path's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.modules as modules
from engine.cache import ForwardBatch, PagedKVCache, Sequence
from engine.engine import Engine, EngineOptions
from kernels.attention import (
    paged_attention,
    paged_attention_reference,
    prompt_attention,
    prompt_attention_applies,
)

from model_factory import make_tiny_llama

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _fresh(T: int, hq: int, hk: int, d: int, dtype: torch.dtype, device: str, page: int = 16):
    """q, k, v of a T-token prompt, and the same K/V stored in a paged cache on shuffled
    pages: (q, k, v, k_cache, v_cache, cu_seqlens, context_lens, page_table)."""
    generator = torch.Generator().manual_seed(T + hq + d)
    q, k, v = (torch.randn(T, h, d, generator=generator) for h in (hq, hk, hk))
    pages = -(-T // page)
    order = torch.randperm(pages + 3, generator=generator)[:pages]
    k_cache = torch.zeros(pages + 3, page, hk, d)
    v_cache = torch.zeros_like(k_cache)
    for i in range(T):
        k_cache[order[i // page], i % page] = k[i]
        v_cache[order[i // page], i % page] = v[i]
    cu = torch.tensor([0, T], dtype=torch.int32)
    ctx = torch.tensor([T], dtype=torch.int32)
    table = order.to(torch.int32)[None]
    tensors = (q, k, v, k_cache, v_cache, cu, ctx, table)
    return [t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(4, 4, 16), (8, 2, 32), (6, 1, 64)], ids=str)
def test_matches_the_paged_reference(heads: tuple[int, int, int], dtype: torch.dtype) -> None:
    q, k, v, kc, vc, cu, ctx, table = _fresh(37, *heads, dtype, "cpu")
    scale = heads[2] ** -0.5 * 1.3
    out = prompt_attention(q, k, v, scale=scale)
    ref = paged_attention_reference(q, kc, vc, cu, ctx, table, scale=scale)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=TOLERANCE[dtype] * 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 16, 64), (8, 1, 256)], ids=str)
def test_gpu_matches_the_paged_prefill_kernel(heads: tuple[int, int, int], dtype: torch.dtype):
    q, k, v, kc, vc, cu, ctx, table = _fresh(777, *heads, dtype, "cuda")
    scale = heads[2] ** -0.5
    out = prompt_attention(q, k, v, scale=scale)
    paged = paged_attention(q, kc, vc, cu, ctx, table, scale=scale)
    ref = paged_attention_reference(q.float(), kc.float(), vc.float(), cu, ctx, table, scale=scale)
    for got in (out, paged):
        error = ((got.float() - ref).norm() / ref.norm()).item()
        assert error < TOLERANCE[dtype], error


def test_when_it_applies() -> None:
    ok = dict(quantized_cache=False, sliding_window=None, softcap=None)
    q = torch.zeros(100, 8, 128)
    assert prompt_attention_applies(q, **ok)
    assert not prompt_attention_applies(q[:1], **ok)  # a one-token prompt: decode kernel
    assert not prompt_attention_applies(q, **{**ok, "quantized_cache": True})
    assert not prompt_attention_applies(q, **{**ok, "softcap": 50.0})
    assert prompt_attention_applies(q, **{**ok, "sliding_window": 100})
    assert not prompt_attention_applies(torch.zeros(101, 8, 128), **{**ok, "sliding_window": 100})
    assert not prompt_attention_applies(torch.zeros(100, 8, 100), **ok)  # not a multiple of 8
    if torch.cuda.is_available():  # float32 on a GPU: no fused kernel, the paged one
        assert not prompt_attention_applies(q.cuda(), **ok)
        assert prompt_attention_applies(q.cuda().half(), **ok)
    with pytest.raises(ValueError, match="query heads"):
        prompt_attention(torch.zeros(3, 6, 8), torch.zeros(3, 4, 8), torch.zeros(3, 4, 8), scale=1)


def test_fresh_marks_only_a_sequence_start() -> None:
    cache = PagedKVCache(
        num_layers=1, num_kv_heads=1, head_dim=8, num_pages=8, page_size=4,
        dtype=torch.float32, layer_devices=[torch.device("cpu")],
    )  # fmt: skip
    a, b = Sequence(), Sequence()
    assert ForwardBatch.build(cache, [a], [[1, 2, 3]]).fresh
    assert not ForwardBatch.build(cache, [a], [[4, 5]]).fresh  # a second chunk
    assert not ForwardBatch.build(cache, [b, Sequence()], [[1, 2], [3]]).fresh  # two sequences
    assert ForwardBatch.build(cache, [Sequence()], [[7]]).on(torch.device("meta")).fresh


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-prompt")
    make_tiny_llama(path, seed=5)
    return path


def test_engine_prefill_equals_the_paged_path(model_dir: Path, monkeypatch) -> None:
    engine = Engine.load(model_dir, EngineOptions(device="cpu", dtype="float32"))
    prompt = [(7 * i + 3) % 200 + 2 for i in range(40)]
    used = []
    real = modules.prompt_attention
    monkeypatch.setattr(
        modules, "prompt_attention", lambda *a, **k: used.append(1) or real(*a, **k)
    )
    seq = Sequence()
    fast = engine.runner.prefill(seq, prompt)
    seq.release(engine.cache)
    assert used, "a fresh prompt takes prompt_attention"
    monkeypatch.setattr(modules, "prompt_attention_applies", lambda *a, **k: False)
    seq = Sequence()
    paged = engine.runner.prefill(seq, prompt)
    seq.release(engine.cache)
    torch.testing.assert_close(fast, paged, rtol=1e-5, atol=1e-5)
