"""The qkv projection's slot sum with RoPE and the native cache write in it (issue 28,
kernels/quant_matmul/slot_sum_rope.py, through kernels/quant_matmul/norm_fold.py's
`quant_matmul_normed_rope`).

What is tested: the rotated q and every byte of both caches equal the unfused pair
(`quant_matmul_normed`, then kernels.apply_rope_write) bit for bit, in float16 and bfloat16,
for 1 and 2 rows (GEMV_MAX_M), full and partial rotary dims, with and without a bias; slots
not written keep their bytes; the same bits on every call; inputs that do not fit are refused."""

from __future__ import annotations

import os

import pytest
import torch

from helpers.quant_weights import make_weight
from helpers.triton_cpu import require_triton, seeded_randn
from kernels.quant_matmul.norm_fold import (
    quant_matmul_normed,
    quant_matmul_normed_rope,
    quant_matmul_residual,
)
from kernels.quant_matmul.slot_sum_rope import RopeCacheWrite
from kernels.rope import apply_rope_write_triton

DTYPES = [torch.float16, torch.bfloat16]
EPS = 1e-5
HQ, HK, D = 4, 2, 32
HIDDEN = 192
MAX_POS = 64
CACHE_SLOTS = 24


def _tables(rotary_dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos, sin [MAX_POS, R/2] as engine.rope builds them (base 10000)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.arange(MAX_POS, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos().to(device), angles.sin().to(device)


def _folded_input(M: int, dtype: torch.dtype, device: str):
    """xw and the squares of a hidden state, as o_proj's slot sum leaves them."""
    qw_o = make_weight(256, HIDDEN, [4], device=device, seed=1)
    x = seeded_randn((M, 256), dtype, device, seed=6)
    residual = seeded_randn((M, HIDDEN), dtype, device, seed=8, scale=4.0)
    weight = seeded_randn((HIDDEN,), dtype, device, seed=9, scale=0.2) + 1
    _, squares, xw = quant_matmul_residual(x, qw_o, residual, weight)
    assert xw is not None
    return xw, squares


def _case(M: int, dtype: torch.dtype, device: str, rotary_dim: int, bias: bool):
    xw, squares = _folded_input(M, dtype, device)
    qw = make_weight(HIDDEN, (HQ + 2 * HK) * D, [4, 3], device=device, seed=2, bias=bias)
    cos, sin = _tables(rotary_dim, device)
    gen = torch.Generator().manual_seed(11)
    positions = torch.randint(1, MAX_POS, (M,), generator=gen).to(device)
    slots = torch.randperm(CACHE_SLOTS, generator=gen)[:M].to(torch.int32).to(device)
    k_cache = seeded_randn((CACHE_SLOTS, HK, D), dtype, device, seed=12)
    v_cache = seeded_randn((CACHE_SLOTS, HK, D), dtype, device, seed=13)
    return xw, squares, qw, RopeCacheWrite(positions, slots, cos, sin, k_cache, v_cache, HQ, HK, D)


def _unfused(xw, squares, qw, dtype, rope: RopeCacheWrite):
    """quant_matmul_normed, then apply_rope_write into copies of the caches."""
    qkv = quant_matmul_normed(xw, squares, EPS, qw, dtype)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    M = qkv.shape[0]
    k_cache, v_cache = rope.k_cache.clone(), rope.v_cache.clone()
    q_rot = apply_rope_write_triton(
        q.view(M, HQ, D), k.view(M, HK, D), v.view(M, HK, D), rope.positions, rope.cos,
        rope.sin, k_cache, v_cache, rope.slots,
    )  # fmt: skip
    return q_rot, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("rotary_dim", [D, D // 2])
@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_slot_sum_is_the_slot_sum_then_rope_write(
    dtype, M, rotary_dim, bias, device
) -> None:
    require_triton(device)
    xw, squares, qw, rope = _case(M, dtype, device, rotary_dim, bias)
    want_q, want_k, want_v = _unfused(xw, squares, qw, dtype, rope)
    before_k, before_v = rope.k_cache.clone(), rope.v_cache.clone()
    q = quant_matmul_normed_rope(xw, squares, EPS, qw, dtype, rope)
    assert q.shape == (M, HQ, D) and q.dtype == dtype
    assert torch.equal(q, want_q)
    assert torch.equal(rope.k_cache, want_k) and torch.equal(rope.v_cache, want_v)
    # Only the rows' slots changed (and they did: random caches, fresh values).
    written = torch.zeros(CACHE_SLOTS, dtype=torch.bool, device=device)
    written[rope.slots.long()] = True
    assert torch.equal(rope.k_cache[~written], before_k[~written])
    assert torch.equal(rope.v_cache[~written], before_v[~written])
    assert not torch.equal(rope.k_cache[written], before_k[written])
    # Not vacuous: at positions past 0 the rotation changes q (the unrotated q differs).
    plain = quant_matmul_normed(xw, squares, EPS, qw, dtype)[:, : HQ * D].view(M, HQ, D)
    assert not torch.equal(q[..., :rotary_dim], plain[..., :rotary_dim])
    if rotary_dim < D:  # the dims past R pass through unrotated
        assert torch.equal(q[..., rotary_dim:], plain[..., rotary_dim:])


def test_the_same_bits_every_call(device) -> None:
    require_triton(device)
    xw, squares, qw, rope = _case(2, torch.float16, device, D, True)
    first = quant_matmul_normed_rope(xw, squares, EPS, qw, torch.float16, rope)
    k_first = rope.k_cache.clone()
    for _ in range(3):
        again = quant_matmul_normed_rope(xw, squares, EPS, qw, torch.float16, rope)
        assert torch.equal(again, first) and torch.equal(rope.k_cache, k_first)


def test_what_does_not_fit_is_refused() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("builds CPU inputs through the interpreter's kernels")
    xw, squares, qw, rope = _case(1, torch.float16, "cpu", D, False)

    def fails(match: str, **changes) -> None:
        import dataclasses

        bad = dataclasses.replace(rope, **changes)
        with pytest.raises(ValueError, match=match):
            quant_matmul_normed_rope(xw, squares, EPS, qw, torch.float16, bad)

    fails("outputs", num_kv_heads=1)  # the qkv width does not match the heads
    fails("k_cache", k_cache=rope.k_cache.to(torch.bfloat16))
    fails("v_cache", v_cache=rope.v_cache[:, :1])
    fails("positions", positions=rope.positions.float())
    fails("slots", slots=rope.slots.repeat(2))
    fails("cos and sin", cos=rope.cos[:, :1], sin=rope.sin)
    fails("cos and sin", cos=torch.zeros(MAX_POS, D), sin=torch.zeros(MAX_POS, D))
    with pytest.raises(ValueError, match="xw must be float32"):
        quant_matmul_normed_rope(xw.half(), squares, EPS, qw, torch.float16, rope)
