"""A qkv projection of an already-normalized input with RoPE and the native cache write in its
slot sum (issue 33, kernels/quant_matmul/qkv_rope.py: a tensor-parallel rank's qkv, whose
input norm ran in the all-reduce kernel, and a step's first layer).

What is tested: the rotated q and every byte of both caches equal the unfused pair
(quant_matmul on the decode GEMV, then kernels.apply_rope_write) bit for bit, in float16 and
bfloat16, for 1 and 2 rows, full and partial rotary dims, with and without a bias, with and
without an input permutation (EXL2's / act-order's perm); slots not written keep their
bytes; inputs it does not take are refused with what was wrong."""

from __future__ import annotations

import pytest
import torch

from helpers.quant_weights import make_weight
from helpers.triton_cpu import require_triton, seeded_randn
from kernels.quant_matmul import quant_matmul_triton
from kernels.quant_matmul.qkv_rope import qkv_rope_applies, quant_matmul_rope
from kernels.quant_matmul.slot_sum_rope import RopeCacheWrite
from kernels.rope import apply_rope_write_triton

DTYPES = [torch.float16, torch.bfloat16]
HQ, HK, D = 4, 2, 32
HIDDEN = 192
MAX_POS = 64
CACHE_SLOTS = 24


def _case(M: int, dtype: torch.dtype, device: str, rotary_dim: int, bias: bool, perm: bool):
    x = seeded_randn((M, HIDDEN), dtype, device, seed=6)
    qw = make_weight(HIDDEN, (HQ + 2 * HK) * D, [4, 3], device=device, seed=2, bias=bias, perm=perm)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.arange(MAX_POS, dtype=torch.float32)[:, None] * inv_freq[None, :]
    gen = torch.Generator().manual_seed(11)
    positions = torch.randint(1, MAX_POS, (M,), generator=gen).to(device)
    slots = torch.randperm(CACHE_SLOTS, generator=gen)[:M].to(torch.int32).to(device)
    k_cache = seeded_randn((CACHE_SLOTS, HK, D), dtype, device, seed=12)
    v_cache = seeded_randn((CACHE_SLOTS, HK, D), dtype, device, seed=13)
    rope = RopeCacheWrite(
        positions, slots, angles.cos().to(device), angles.sin().to(device), k_cache, v_cache,
        HQ, HK, D,
    )  # fmt: skip
    return x, qw, rope


def _unfused(x, qw, rope: RopeCacheWrite):
    """The decode GEMV's quant_matmul, then apply_rope_write into copies of the caches."""
    qkv = quant_matmul_triton(x, qw, path="gemv")
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    M = qkv.shape[0]
    k_cache, v_cache = rope.k_cache.clone(), rope.v_cache.clone()
    q_rot = apply_rope_write_triton(
        q.view(M, HQ, D), k.view(M, HK, D), v.view(M, HK, D), rope.positions, rope.cos,
        rope.sin, k_cache, v_cache, rope.slots,
    )  # fmt: skip
    return q_rot, k_cache, v_cache, q.view(M, HQ, D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize(
    ("rotary_dim", "bias", "perm"), [(D, False, False), (D // 2, True, False), (D, True, True)]
)
def test_the_fused_projection_is_the_gemv_then_rope_write(
    dtype, M, rotary_dim, bias, perm, device
) -> None:
    require_triton(device)
    x, qw, rope = _case(M, dtype, device, rotary_dim, bias, perm)
    assert (qw.perm is not None) == perm
    want_q, want_k, want_v, plain = _unfused(x, qw, rope)
    before_k, before_v = rope.k_cache.clone(), rope.v_cache.clone()
    q = quant_matmul_rope(x, qw, rope)
    assert q.shape == (M, HQ, D) and q.dtype == dtype
    assert torch.equal(q, want_q)
    assert torch.equal(rope.k_cache, want_k) and torch.equal(rope.v_cache, want_v)
    written = torch.zeros(CACHE_SLOTS, dtype=torch.bool, device=device)
    written[rope.slots.long()] = True
    assert torch.equal(rope.k_cache[~written], before_k[~written])
    assert torch.equal(rope.v_cache[~written], before_v[~written])
    assert not torch.equal(rope.k_cache[written], before_k[written])
    # Not vacuous: the rotation changed q where it applies, and only there.
    assert not torch.equal(q[..., :rotary_dim], plain[..., :rotary_dim])
    if rotary_dim < D:
        assert torch.equal(q[..., rotary_dim:], plain[..., rotary_dim:])


def test_what_it_does_not_take_is_refused(device) -> None:
    require_triton(device)
    x, qw, rope = _case(1, torch.float16, device, D, False, False)
    assert qkv_rope_applies(x, qw, rope.width)
    too_many = seeded_randn((3, HIDDEN), torch.float16, device, seed=7)
    for bad_x, why in ((too_many, "3 rows"), (x.float(), "float32")):
        assert not qkv_rope_applies(bad_x, qw, rope.width), why
        with pytest.raises(ValueError, match="quant_matmul_rope takes"):
            quant_matmul_rope(bad_x, qw, rope)
    import dataclasses

    narrow = dataclasses.replace(rope, num_kv_heads=1)  # the heads' width is not W's outputs
    assert not qkv_rope_applies(x, qw, narrow.width)
    with pytest.raises(ValueError, match="192 outputs .* out_features 256"):
        quant_matmul_rope(x, qw, narrow)
    with pytest.raises(ValueError, match="in_features"):
        quant_matmul_rope(x[:, :-1], qw, rope)
