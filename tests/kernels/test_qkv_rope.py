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


def _tables(rotary_dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos, sin [MAX_POS, R/2] as engine.rope builds them (base 10000)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.arange(MAX_POS, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos().to(device), angles.sin().to(device)


def _case(M: int, dtype: torch.dtype, device: str, rotary_dim: int, bias: bool, perm: bool):
    x = seeded_randn((M, HIDDEN), dtype, device, seed=6)
    qw = make_weight(HIDDEN, (HQ + 2 * HK) * D, [4, 3], device=device, seed=2, bias=bias, perm=perm)
    gen = torch.Generator().manual_seed(11)
    positions = torch.randint(1, MAX_POS, (M,), generator=gen).to(device)
    slots = torch.randperm(CACHE_SLOTS, generator=gen)[:M].to(torch.int32).to(device)
    k_cache = seeded_randn((CACHE_SLOTS, HK, D), dtype, device, seed=12)
    v_cache = seeded_randn((CACHE_SLOTS, HK, D), dtype, device, seed=13)
    cos, sin = _tables(rotary_dim, device)
    rope = RopeCacheWrite(positions, slots, cos, sin, k_cache, v_cache, HQ, HK, D)
    return x, qw, rope


def _unfused(x, qw, rope: RopeCacheWrite):
    """The decode GEMV's quant_matmul, then apply_rope_write into copies of the caches:
    (rotated q, k cache, v cache, q before the rotation)."""
    hq, hk, d = rope.num_heads, rope.num_kv_heads, rope.head_dim
    qkv = quant_matmul_triton(x, qw, path="gemv")
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    M = qkv.shape[0]
    k_cache, v_cache = rope.k_cache.clone(), rope.v_cache.clone()
    q_rot = apply_rope_write_triton(
        q.view(M, hq, d), k.view(M, hk, d), v.view(M, hk, d), rope.positions, rope.cos,
        rope.sin, k_cache, v_cache, rope.slots,
    )  # fmt: skip
    return q_rot, k_cache, v_cache, q.view(M, hq, d)


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


def test_a_large_bias_is_added_where_the_unfused_gemv_adds_it(device) -> None:
    """The bias goes into split 0's partial, as the unfused GEMV adds it, not after the
    sum (as the folded norm must): with a bias the size of Qwen2's k/v biases and many
    split-K slots, adding it last rounds some sums differently."""
    require_triton(device)
    hq, hk, d, k = 8, 2, 64, 1024
    x = seeded_randn((2, k), torch.float16, device, seed=0)
    qw = make_weight(k, (hq + 2 * hk) * d, [4], device=device, seed=30, bias=True, perm=False)
    assert qw.bias is not None
    qw.bias.mul_(100.0)
    slots = torch.tensor([3, 9], dtype=torch.int32, device=device)
    # Position 0 rotates by nothing (cos 1, sin 0): every rounding of the sums shows.
    positions = torch.tensor([0, 0], device=device)
    caches = [torch.zeros(CACHE_SLOTS, hk, d, dtype=torch.float16, device=device) for _ in "kv"]
    cos, sin = _tables(d, device)
    rope = RopeCacheWrite(positions, slots, cos, sin, caches[0], caches[1], hq, hk, d)
    q_want, k_want, v_want, _ = _unfused(x, qw, rope)
    got = quant_matmul_rope(x, qw, rope)
    assert torch.equal(got, q_want)
    assert torch.equal(rope.k_cache, k_want) and torch.equal(rope.v_cache, v_want)
