"""The fused small-op kernels of the decode step, each against its torch reference and
against the separate ops it replaces:

- kernels.add_rms_norm: residual add + RMSNorm (one launch, both outputs);
- kernels.silu_mul: SiLU(gate) * up;
- kernels.apply_rope_write: RoPE + the write of k and v into a native paged KV cache.

On CPU the Triton kernels run in the interpreter; on a GPU the same tests run on CUDA
tensors, and the `gpu` tests check that the fused CUDA path equals the unfused one bit for
bit (it rounds where the separate ops round).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels import add_rms_norm, apply_rope, apply_rope_write, rms_norm, silu_mul
from kernels.activation import silu_mul_reference, silu_mul_triton
from kernels.rms_norm import add_rms_norm_reference, add_rms_norm_triton, rms_norm_triton
from kernels.rope import apply_rope_triton, apply_rope_write_reference, apply_rope_write_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5


def _require_triton(device: str) -> None:
    # One process is either interpreted or compiled (triton.jit decides at import): on a GPU
    # machine the interpreter is off, so the Triton path cannot take CPU tensors there.
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (unset on GPU machines)")


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-6}
    # Two ulps relative; the atol covers float16 subnormals.
    return {"rtol": 2 * torch.finfo(dtype).eps, "atol": 1e-6}


def _randn(shape: tuple[int, ...], generator: torch.Generator, scale: float = 3.0):
    return scale * torch.randn(shape, generator=generator)


# ---------------------------------------------------------------------------------------------
# add_rms_norm

NORM_SHAPES = [
    (1, 72),  # one decode row
    (5, 576),  # SmolLM2-135M
    (3, 4099),  # odd width, a partial last block
    (2, 3, 64),  # leading [batch, seq]
    (2, 20000),  # past the single-pass limit: the looped kernel
]


def _norm_inputs(shape, dtype, device, *, seed: int, weight_dtype=None):
    generator = torch.Generator().manual_seed(seed)
    x = _randn(shape, generator)
    residual = _randn(shape, generator)
    weight = 1 + 0.5 * torch.randn(shape[-1], generator=generator)
    return (
        x.to(device, dtype),
        residual.to(device, dtype),
        weight.to(device, weight_dtype or dtype),
    )


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_add_rms_norm_triton_matches_reference(
    device: str, shape: tuple[int, ...], dtype: torch.dtype, unit_offset: bool
) -> None:
    _require_triton(device)
    x, residual, weight = _norm_inputs(shape, dtype, device, seed=sum(shape))
    want_normed, want_sum = add_rms_norm(
        x, residual, weight, EPS, unit_offset=unit_offset, backend="torch"
    )
    normed, summed = add_rms_norm(
        x, residual, weight, EPS, unit_offset=unit_offset, backend="triton"
    )
    assert normed.shape == summed.shape == x.shape
    assert normed.dtype == want_normed.dtype and summed.dtype == dtype
    # The sum is one rounding of an exact float32 add on both paths: equal bit for bit.
    assert torch.equal(summed, want_sum)
    torch.testing.assert_close(normed, want_normed, **_tolerance(dtype))
    # The norm is rms_norm's kernel code reading the rounded sum: equal bit for bit.
    assert torch.equal(normed, rms_norm_triton(want_sum, weight, EPS, unit_offset=unit_offset))


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_reference_is_the_unfused_ops(dtype: torch.dtype, unit_offset: bool) -> None:
    x, residual, weight = _norm_inputs((4, 200), dtype, "cpu", seed=7)
    normed, summed = add_rms_norm_reference(x, residual, weight, EPS, unit_offset=unit_offset)
    assert torch.equal(summed, residual + x)
    expected = rms_norm(residual + x, weight, EPS, unit_offset=unit_offset, backend="torch")
    assert torch.equal(normed, expected)
    # ... which is not the same as norming the float32 sum (the rounding matters).
    if dtype != torch.float32:
        unrounded = rms_norm(residual.float() + x.float(), weight, EPS, unit_offset=unit_offset)
        assert not torch.equal(normed.float(), unrounded.to(normed.dtype).float())


def test_add_rms_norm_float32_weight_and_strided_rows(device: str) -> None:
    _require_triton(device)
    generator = torch.Generator().manual_seed(11)
    base_x = _randn((6, 2, 100), generator).to(device, torch.bfloat16)
    base_r = _randn((6, 300), generator).to(device, torch.bfloat16)
    weight = (1 + 0.5 * torch.randn(100, generator=generator)).to(device)
    x, residual = base_x[:, 1], base_r[:, 100:200]  # strided rows, dense last dim
    assert not x.is_contiguous() and not residual.is_contiguous()
    transposed = _randn((100, 6), generator).to(device, torch.bfloat16).t()  # last dim strided
    for xs, rs in ((x, residual), (transposed, residual)):
        want = add_rms_norm_reference(xs.contiguous(), rs.contiguous(), weight, EPS)
        got = add_rms_norm_triton(xs, rs, weight, EPS)
        assert got[0].dtype == torch.float32 and got[0].is_contiguous() and got[1].is_contiguous()
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], **_tolerance(torch.float32))
    # The inputs are left alone (out of place).
    assert torch.equal(base_r[:, 100:200], residual)


def test_add_rms_norm_empty_and_bad_arguments(device: str) -> None:
    _require_triton(device)
    x, residual, weight = _norm_inputs((0, 64), torch.float16, device, seed=1)
    normed, summed = add_rms_norm(x, residual, weight, EPS, backend="triton")
    assert normed.shape == summed.shape == (0, 64)
    x, residual, weight = _norm_inputs((2, 64), torch.float16, "cpu", seed=1)
    with pytest.raises(ValueError, match="residual must match"):
        add_rms_norm(x, residual.float(), weight, EPS)
    with pytest.raises(ValueError, match="residual must match"):
        add_rms_norm(x, residual[:1], weight, EPS)
    with pytest.raises(ValueError, match="weight must have shape"):
        add_rms_norm(x, residual, weight[:32], EPS)


# ---------------------------------------------------------------------------------------------
# silu_mul

ACT_SHAPES = [(1, 1), (1, 1000), (3, 7), (4, 2053), (2, 3, 160)]


def _gate_up(shape, dtype, device, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up as the halves of one [..., 2I] projection output (strided rows)."""
    generator = torch.Generator().manual_seed(seed)
    fused = _randn((*shape[:-1], 2 * shape[-1]), generator)
    # Some large magnitudes: exp(-x) overflows to inf (silu -> -0) and underflows to 0.
    fused.view(-1)[:: max(1, fused.numel() // 5)] = 40.0
    fused.view(-1)[1 :: max(1, fused.numel() // 5)] = -100.0
    return fused.to(device, dtype).chunk(2, dim=-1)


# numpy's exp (the interpreter's) warns where exp(-x) overflows to inf, as intended.
IGNORE_EXP_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered in exp")


@IGNORE_EXP_OVERFLOW
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ACT_SHAPES)
def test_silu_mul_triton_matches_reference(
    device: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    _require_triton(device)
    gate, up = _gate_up(shape, dtype, device, seed=sum(shape))
    expected = silu_mul(gate, up, backend="torch")
    actual = silu_mul(gate, up, backend="triton")
    assert actual.shape == gate.shape and actual.dtype == dtype and actual.is_contiguous()
    # The interpreter's exp is numpy's, not torch's: silu may differ by an ulp before the
    # product's rounding, so up to an ulp of the output.
    torch.testing.assert_close(actual, expected, **_tolerance(dtype))


@IGNORE_EXP_OVERFLOW
def test_silu_mul_reference_and_arguments(device: str) -> None:
    gate, up = _gate_up((3, 50), torch.bfloat16, "cpu", seed=3)
    assert torch.equal(silu_mul_reference(gate, up), F.silu(gate) * up)
    with pytest.raises(ValueError, match="one shape"):
        silu_mul(gate, up[:, :10])
    with pytest.raises(ValueError, match="share one of"):
        silu_mul(gate, up.float())
    _require_triton(device)
    empty = torch.empty(0, 16, device=device)
    assert silu_mul(empty, empty, backend="triton").shape == (0, 16)
    # Separate, contiguous gate and up (unfused projections, MoE experts).
    gate, up = (t.contiguous().to(device) for t in _gate_up((5, 33), torch.float16, "cpu", seed=4))
    torch.testing.assert_close(
        silu_mul_triton(gate, up), silu_mul_reference(gate, up), **_tolerance(torch.float16)
    )


# ---------------------------------------------------------------------------------------------
# apply_rope_write

MAX_POS = 300
# (T, Hq, Hk, D, R)
ROPE_CASES = [
    (1, 1, 1, 8, 8),  # one decode token
    (7, 4, 2, 64, 64),  # grouped-query attention
    (5, 3, 3, 72, 72),  # R/2 = 36, not a power of two
    (6, 4, 1, 80, 32),  # partial rotary (Phi-2 style), head dim not a power of two
    (4, 40, 8, 128, 128),  # several q head blocks per token, a partial last block
]


def _tables(rotary_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    exponents = torch.arange(0, rotary_dims, 2, dtype=torch.int64).float() / rotary_dims
    angles = torch.arange(MAX_POS, dtype=torch.float32)[:, None] / (10000.0**exponents)[None, :]
    return angles.cos(), angles.sin()


def _rope_inputs(case, dtype, device, *, index_dtype=torch.int64, page_size: int = 4):
    """q, k, v as views of one fused qkv output, tables, positions, slots and two caches."""
    T, n_q, n_k, D, R = case
    generator = torch.Generator().manual_seed(T * 1000 + D + R)
    qkv = _randn((T, (n_q + 2 * n_k) * D), generator, scale=2.0).to(device, dtype)
    q, k, v = qkv.split([n_q * D, n_k * D, n_k * D], dim=-1)
    q, k, v = q.view(T, n_q, D), k.view(T, n_k, D), v.view(T, n_k, D)
    cos, sin = (t.to(device) for t in _tables(R))
    positions = torch.randint(0, MAX_POS, (T,), generator=generator).to(device, index_dtype)
    pages = -(-2 * T // page_size) + 1
    slots = torch.randperm(pages * page_size, generator=generator)[:T].to(device, index_dtype)
    cache = _randn((pages, page_size, n_k, D), generator).to(device, dtype)
    return q, k, v, positions, cos, sin, cache, cache.clone() - 1, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_write_triton_matches_reference(
    device: str, case: tuple[int, ...], dtype: torch.dtype
) -> None:
    _require_triton(device)
    q, k, v, positions, cos, sin, k_cache, v_cache, slots = _rope_inputs(case, dtype, device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = apply_rope_write(q, k, v, positions, cos, sin, ref_k, ref_v, slots, backend="torch")
    actual = apply_rope_write(
        q, k, v, positions, cos, sin, k_cache, v_cache, slots, backend="triton"
    )
    assert actual.shape == q.shape and actual.dtype == dtype and actual.is_contiguous()
    # The rotation rounds as the reference does (kernels.rope) and the rest are copies:
    # q, both caches (written slots and untouched ones) are equal bit for bit.
    assert torch.equal(actual, expected)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_kernel_modes_agree(device: str, case: tuple[int, ...], dtype: torch.dtype) -> None:
    # apply_rope and apply_rope_write launch one kernel (`_rope_kernel`, WRITE_CACHE off or
    # on): the rotated q and the keys written into the cache are apply_rope's, bit for bit.
    _require_triton(device)
    q, k, v, positions, cos, sin, k_cache, v_cache, slots = _rope_inputs(case, dtype, device)
    q_rot, k_rot = apply_rope_triton(q, k, positions, cos, sin)
    q_written = apply_rope_write_triton(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
    n_k, D = k.shape[1:]
    assert torch.equal(q_written, q_rot)
    assert torch.equal(k_cache.view(-1, n_k, D)[slots.long()], k_rot)
    assert torch.equal(v_cache.view(-1, n_k, D)[slots.long()], v)


def test_rope_write_reference_is_rope_then_index_copy() -> None:
    case = (5, 4, 2, 64, 48)
    q, k, v, positions, cos, sin, k_cache, v_cache, slots = _rope_inputs(
        case, torch.bfloat16, "cpu", index_dtype=torch.int32
    )
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = apply_rope(q, k, positions, cos, sin)
    want_k.view(-1, 2, 64)[slots.long()] = k_rot
    want_v.view(-1, 2, 64)[slots.long()] = v
    got = apply_rope_write_reference(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(got, q_rot)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_rope_write_int32_indices_and_contiguous_inputs(device: str) -> None:
    _require_triton(device)
    case = (3, 2, 2, 64, 64)
    q, k, v, positions, cos, sin, k_cache, v_cache, slots = _rope_inputs(
        case, torch.float16, device, index_dtype=torch.int32
    )
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = apply_rope_write_reference(q, k, v, positions, cos, sin, ref_k, ref_v, slots)
    actual = apply_rope_write_triton(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(actual, expected)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_rope_write_rejects_bad_caches() -> None:
    q, k, v, positions, cos, sin, k_cache, v_cache, slots = _rope_inputs(
        (2, 2, 1, 16, 16), torch.float16, "cpu"
    )
    with pytest.raises(ValueError, match="native cache"):
        apply_rope_write(q, k, v, positions, cos, sin, k_cache.float(), v_cache, slots)
    with pytest.raises(ValueError, match="native cache"):
        apply_rope_write(q, k, v, positions, cos, sin, k_cache[..., :8], v_cache, slots)
    with pytest.raises(ValueError, match="contiguous"):
        apply_rope_write(q, k, v, positions, cos, sin, k_cache, v_cache[:, ::2], slots)
    with pytest.raises(ValueError, match="slots"):
        apply_rope_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots[:1])
    with pytest.raises(ValueError, match="v must match k"):
        apply_rope_write(q, k, v[:, :, :8], positions, cos, sin, k_cache, v_cache, slots)


# ---------------------------------------------------------------------------------------------
# On a GPU: the fused CUDA kernels against the unfused CUDA path, bit for bit.


@pytest.mark.gpu
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4096), (8, 4096), (3, 5120), (2, 20000)])
def test_add_rms_norm_cuda_equals_unfused(
    shape: tuple[int, int], dtype: torch.dtype, unit_offset: bool
) -> None:
    x, residual, weight = _norm_inputs(shape, dtype, "cuda", seed=shape[1])
    normed, summed = add_rms_norm(x, residual, weight, EPS, unit_offset=unit_offset)
    unfused_sum = residual + x
    assert torch.equal(summed, unfused_sum)
    assert torch.equal(normed, rms_norm(unfused_sum, weight, EPS, unit_offset=unit_offset))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 14336), (8, 14336), (5, 2053)])
def test_silu_mul_cuda_equals_torch(shape: tuple[int, int], dtype: torch.dtype) -> None:
    gate, up = _gate_up(shape, dtype, "cuda", seed=shape[1])
    # libdevice's expf and an IEEE division: torch's CUDA silu, bit for bit.
    assert torch.equal(silu_mul(gate, up), F.silu(gate) * up)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(1, 32, 8, 128, 128), (8, 32, 8, 128, 128), (5, 24, 8, 96, 32)])
def test_rope_write_cuda_equals_unfused(case: tuple[int, ...], dtype: torch.dtype) -> None:
    q, k, v, positions, cos, sin, k_cache, v_cache, slots = _rope_inputs(
        case, dtype, "cuda", page_size=16
    )
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = apply_rope_triton(q, k, positions, cos, sin)
    n_k, D = k.shape[1:]
    ref_k.view(-1, n_k, D).index_copy_(0, slots, k_rot)
    ref_v.view(-1, n_k, D).index_copy_(0, slots, v)
    assert torch.equal(
        apply_rope_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots), q_rot
    )
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
