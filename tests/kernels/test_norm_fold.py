"""RMSNorm folded into the decode GEMVs around it (issue 28, kernels/quant_matmul/norm_fold.py):
the slot sum of o_proj/down_proj adds the residual and writes partial sums of squares, and
the next GEMV applies the norm to x as it loads it. Bit for bit the unfused ops
(add_rms_norm's residual output; rms_norm followed by the GEMV) in float16 and bfloat16,
over several k, slot counts, chunk sizes, rows, permuted or not, Llama's and Gemma's norms,
with and without gate_up's silu_mul."""

from __future__ import annotations

import os

import pytest
import torch

from helpers.quant_weights import make_weight
from kernels.activation import silu_mul_triton
from kernels.quant_matmul import quant_matmul_triton
from kernels.quant_matmul.gemv import gemv_tiling, launch_gemv_residual
from kernels.quant_matmul.norm_fold import (
    norm_fold_applies,
    quant_matmul_normed,
    quant_matmul_residual,
)
from kernels.quant_matmul.slot_sum import RowSquares, SlotSumConfig
from kernels.rms_norm import add_rms_norm_triton, rms_norm_triton

DTYPES = [torch.float16, torch.bfloat16]
EPS = 1e-5


def _require_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (unset on GPU machines)")


def _rand(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def _pairwise(values: torch.Tensor) -> torch.Tensor:
    """kernels.rms_norm's pairwise tree in torch, over the last dim padded to a power of 2."""
    size = 1 << max(values.shape[-1] - 1, 0).bit_length()
    v = torch.nn.functional.pad(values.float(), (0, size - values.shape[-1]))
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def _residual_sum(x, qw, residual, iters=None, block=None):
    x2d = x.reshape(-1, qw.in_features)
    h = torch.empty_like(residual)
    tiling = gemv_tiling(x2d, qw, iters=iters)
    config = SlotSumConfig(block, 1) if block is not None else None
    squares = launch_gemv_residual(x2d, qw, residual, h, tiling, config=config)
    return h, squares, tiling.arrivals


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize(
    ("k", "n", "iters", "block"),
    [(320, 96, 1, 32), (320, 96, None, None), (1024, 320, 2, 64), (96, 1000, 1, 128)],
)
def test_residual_slot_sum_is_add_rms_norms_sum(dtype, M, k, n, iters, block, device) -> None:
    """h == add_rms_norm(GEMV y, residual)'s residual output; each chunk's square sum is the
    pairwise tree of its part of h's row; the chunks finish to the whole row's tree."""
    _require_triton(device)
    qw = make_weight(k, n, [4, 3], device=device, seed=k + n, bias=True)
    x = _rand((M, k), dtype, device, seed=1, scale=0.5)
    residual = _rand((M, n), dtype, device, seed=2, scale=2.0)
    y = quant_matmul_triton(x, qw, path="gemv")
    _, want_h = add_rms_norm_triton(y, residual, torch.ones(n, dtype=dtype, device=device), EPS)
    for _ in range(2):  # the workspace as the first call left it
        h, squares, slots = _residual_sum(x, qw, residual, iters, block)
        assert torch.equal(h, want_h)
    assert slots > 1
    chunk = squares.chunk
    assert block is None or chunk == block
    assert squares.sums.shape == (M, -(-n // chunk))
    padded = torch.nn.functional.pad(h.float(), (0, squares.chunks * chunk - n))
    per_chunk = _pairwise(padded.view(M, squares.chunks, chunk) ** 2)
    assert torch.equal(squares.sums, per_chunk)
    assert torch.equal(_pairwise(squares.sums), _pairwise(h.float() ** 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize(
    ("d", "block", "perm"),
    [(64, 32, True), (320, 32, False), (320, 128, True), (1000, 64, True), (1000, 256, False)],
)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_folded_gemv_is_rms_norm_then_the_gemv(
    dtype, M, d, block, perm, unit_offset, silu_mul, device
) -> None:
    """quant_matmul_normed(h, squares) == GEMV(rms_norm(h)) bit for bit, h and its squares
    from the residual slot sum (as in a decoder layer), whatever the chunk size."""
    _require_triton(device)
    qw_out = make_weight(128, d, [4], device=device, seed=d, bias=False)
    x = _rand((M, 128), dtype, device, seed=3, scale=0.5)
    residual = _rand((M, d), dtype, device, seed=4, scale=3.0)
    h, squares, _ = _residual_sum(x, qw_out, residual, block=block)
    weight = _rand((d,), dtype, device, seed=5, scale=0.3) + (0 if unit_offset else 1)
    qw = make_weight(d, 2 * 72, [4, 8], device=device, seed=7, perm=perm, bias=True)
    normed = rms_norm_triton(h, weight, EPS, unit_offset=unit_offset)
    want = quant_matmul_triton(normed, qw, path="gemv")
    if silu_mul:
        want = silu_mul_triton(*want.chunk(2, dim=-1))
    for _ in range(2):
        got = quant_matmul_normed(
            h, squares, weight, EPS, qw, unit_offset=unit_offset, silu_mul=silu_mul
        )
        assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_public_pair_is_add_rms_norm_then_the_gemv(dtype, device) -> None:
    """quant_matmul_residual then quant_matmul_normed, leading dims kept: the unfused
    GEMV -> add_rms_norm -> GEMV, both outputs."""
    _require_triton(device)
    qw_o = make_weight(256, 192, [4], device=device, seed=1)
    qw_qkv = make_weight(192, 320, [4], device=device, seed=2)
    x = _rand((1, 1, 256), dtype, device, seed=6)
    residual = _rand((1, 1, 192), dtype, device, seed=8, scale=4.0)
    weight = _rand((192,), dtype, device, seed=9, scale=0.2) + 1
    normed, want_h = add_rms_norm_triton(quant_matmul_triton(x, qw_o), residual, weight, EPS)
    want = quant_matmul_triton(normed, qw_qkv)
    assert norm_fold_applies(x, qw_o, "out") and norm_fold_applies(want_h, qw_qkv, "in")
    h, squares = quant_matmul_residual(x, qw_o, residual)
    got = quant_matmul_normed(h, squares, weight, EPS, qw_qkv)
    assert h.shape == want_h.shape and torch.equal(h, want_h)
    assert got.shape == want.shape and torch.equal(got, want)


def test_the_order_of_the_squares_matters() -> None:
    """Not vacuous: summed in another order (left to right) the squares of the test rows
    give other float32 bits, and an rstd a little off changes the GEMV's output: equal bits
    above need the same tree in the slot sum, the GEMV and rms_norm."""
    _require_triton("cpu")
    dtype, d = torch.float16, 1000
    qw_out = make_weight(128, d, [4], seed=d, bias=False)
    h, squares, _ = _residual_sum(
        _rand((1, 128), dtype, "cpu", 3), qw_out, _rand((1, d), dtype, "cpu", 4, 3.0), block=32
    )
    left_to_right = torch.zeros((), dtype=torch.float32)
    for v in h.float()[0] ** 2:
        left_to_right = left_to_right + v
    assert not torch.equal(left_to_right, _pairwise(squares.sums)[0])
    weight = _rand((d,), dtype, "cpu", seed=5, scale=0.3) + 1
    qw = make_weight(d, 256, [4], seed=7)
    want = quant_matmul_normed(h, squares, weight, EPS, qw)
    off = RowSquares(squares.sums * (1 + 2.0**-14), squares.chunk)
    assert not torch.equal(quant_matmul_normed(h, off, weight, EPS, qw), want)


def test_what_does_not_fold_is_refused() -> None:
    qw = make_weight(64, 64, [4], seed=1)
    x = torch.zeros(3, 64, dtype=torch.float16)  # the dot path's rows
    assert not norm_fold_applies(x, qw, "in") and not norm_fold_applies(x, qw, "out")
    assert not norm_fold_applies(x[:1].float(), qw, "in")
    with pytest.raises(ValueError, match="decode GEMV"):
        quant_matmul_residual(x, qw, torch.zeros(3, 64, dtype=torch.float16))
    squares = RowSquares(torch.zeros(1, 2), 32)
    with pytest.raises(ValueError, match="weight"):
        quant_matmul_normed(x[:1], squares, torch.ones(64), EPS, qw)  # float32 weight


def test_only_the_normed_width_is_bounded() -> None:
    """The width a norm must fit in one pass is the norm's: a Llama-3-8B gate_up (n =
    28,672, over MAX_SINGLE_PASS_D) folds the norm over its k, and a down_proj whose k is
    over it still ends in the next norm. Bounding max(k, n) kept every 8B-class model off
    the fold. Scaled down here: k 64 with n past the bound, bits as the unfused ops."""
    _require_triton("cpu")
    from kernels.rms_norm import MAX_SINGLE_PASS_D

    dtype, d, wide = torch.float16, 64, MAX_SINGLE_PASS_D + 128
    h = _rand((1, d), dtype, "cpu", seed=11)
    weight = _rand((d,), dtype, "cpu", seed=12, scale=0.2) + 1
    gate_up = make_weight(d, 2 * wide, [4], seed=13)
    assert norm_fold_applies(h, gate_up, "in") and not norm_fold_applies(h, gate_up, "out")
    x, o_proj = _rand((1, 32), dtype, "cpu", seed=14), make_weight(32, d, [4], seed=15)
    h_next, squares = quant_matmul_residual(x, o_proj, h)
    normed_h, want_h = add_rms_norm_triton(quant_matmul_triton(x, o_proj), h, weight, EPS)
    assert torch.equal(h_next, want_h)
    want = silu_mul_triton(*quant_matmul_triton(normed_h, gate_up, path="gemv").chunk(2, dim=-1))
    got = quant_matmul_normed(h_next, squares, weight, EPS, gate_up, silu_mul=True)
    assert torch.equal(got, want)
    down = make_weight(wide, d, [4], seed=16)
    assert norm_fold_applies(got[..., :wide], down, "out")
    assert not norm_fold_applies(got[..., :wide], down, "in")
