"""RMSNorm folded into the decode GEMVs around it (issue 28, kernels/quant_matmul/norm_fold.py):
the slot sum of o_proj/down_proj adds the residual, writes partial sums of squares and
xw = h * w (float32, exact); the next GEMV reads xw as x and its slot sum applies rstd,
then the bias (rms_norm(h) @ W = rstd * ((h * w) @ W)).

What is tested: h and the squares are add_rms_norm's bits; xw is h * w exactly; the
folded product is as accurate as rms_norm + GEMV (each against a float64 reference: the
fold's error at most twice the unfused path's) in float16 and bfloat16, over several k,
chunk sizes, rows, permuted or not, Llama's and Gemma's norms, with and without gate_up's
silu_mul; it gives the same bits on every call and whatever the chunk of the squares; and
the slot sum applies rstd exactly once and leaves the bias unscaled."""

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
from kernels.quant_matmul.reference import dequantize_reference
from kernels.quant_matmul.slot_sum import RowSquares, SlotNorm, SlotSumConfig, launch_slot_sum
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


def _residual_sum(x, qw, residual, iters=None, block=None, weight=None, unit_offset=False):
    x2d = x.reshape(-1, qw.in_features)
    h = torch.empty_like(residual)
    xw = torch.empty(residual.shape, dtype=torch.float32) if weight is not None else None
    tiling = gemv_tiling(x2d, qw, iters=iters)
    config = SlotSumConfig(block, 1) if block is not None else None
    squares = launch_gemv_residual(
        x2d, qw, residual, h, tiling, norm_weight=weight, unit_offset=unit_offset, xw=xw,
        config=config,
    )  # fmt: skip
    return h, squares, xw, tiling.arrivals


def _scaled(w: torch.Tensor, unit_offset: bool) -> torch.Tensor:
    return 1 + w.double() if unit_offset else w.double()


def _reference(h, weight, qw, unit_offset, silu_mul) -> torch.Tensor:
    """rms_norm(h) @ W + bias (silu(gate) * up with silu_mul) in float64, from h's bits."""
    hd = h.double()
    rstd = torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS)
    y = (hd * rstd * _scaled(weight, unit_offset)) @ dequantize_reference(qw).double()
    if qw.bias is not None:
        y = y + qw.bias.double()
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y


def _assert_as_accurate(got: torch.Tensor, unfused: torch.Tensor, ref: torch.Tensor) -> None:
    """The fold's error against the float64 reference is at most twice the unfused path's,
    in its largest and in its mean (both paths round their x and their output once)."""
    # Finite everywhere: an fp16 overflow to inf on both paths would pass any bound.
    assert torch.isfinite(ref).all() and torch.isfinite(unfused).all()
    err_fold = (got.double() - ref).abs()
    err_unfused = (unfused.double() - ref).abs()
    assert err_unfused.max() > 0  # the bound below is not vacuous
    assert err_fold.max() <= 2 * err_unfused.max(), (err_fold.max(), err_unfused.max())
    assert err_fold.mean() <= 2 * err_unfused.mean(), (err_fold.mean(), err_unfused.mean())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize(
    ("k", "n", "iters", "block"),
    [(320, 96, 1, 32), (320, 96, None, None), (1024, 320, 2, 64), (96, 1000, 1, 128)],
)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_residual_slot_sum_is_add_rms_norms_sum(
    dtype, M, k, n, iters, block, unit_offset, device
) -> None:
    """h == add_rms_norm(GEMV y, residual)'s residual output; each chunk's square sum is the
    pairwise tree of its part of h's row; the chunks finish to the whole row's tree; xw is
    h * w (h * (1 + w)) in float32, exact."""
    _require_triton(device)
    qw = make_weight(k, n, [4, 3], device=device, seed=k + n, bias=True)
    x = _rand((M, k), dtype, device, seed=1, scale=0.5)
    residual = _rand((M, n), dtype, device, seed=2, scale=2.0)
    weight = _rand((n,), dtype, device, seed=3, scale=0.3) + (0 if unit_offset else 1)
    y = quant_matmul_triton(x, qw, path="gemv")
    _, want_h = add_rms_norm_triton(y, residual, torch.ones(n, dtype=dtype, device=device), EPS)
    scaled = 1 + weight.float() if unit_offset else weight.float()
    want_xw = want_h.float() * scaled
    for _ in range(2):  # the workspace as the first call left it
        h, squares, xw, slots = _residual_sum(x, qw, residual, iters, block, weight, unit_offset)
        assert torch.equal(h, want_h) and torch.equal(xw, want_xw)
    assert slots > 1
    chunk = squares.chunk
    assert block is None or chunk == block
    assert squares.sums.shape == (M, -(-n // chunk))
    padded = torch.nn.functional.pad(h.float(), (0, squares.chunks * chunk - n))
    per_chunk = _pairwise(padded.view(M, squares.chunks, chunk) ** 2)
    assert torch.equal(squares.sums, per_chunk)
    assert torch.equal(_pairwise(squares.sums), _pairwise(h.float() ** 2))
    plain_h, plain_squares, _, _ = _residual_sum(x, qw, residual, iters, block)  # no xw
    assert torch.equal(plain_h, h) and torch.equal(plain_squares.sums, squares.sums)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize(
    ("d", "block", "perm"), [(64, 32, True), (320, 128, True), (1000, 64, True), (1000, 256, False)]
)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_folded_gemv_is_as_accurate_as_rms_norm_then_the_gemv(
    dtype, M, d, block, perm, unit_offset, silu_mul, device
) -> None:
    """quant_matmul_normed(xw, squares) against GEMV(rms_norm(h)), both against float64, h,
    xw and its squares from the residual slot sum (as in a decoder layer); the same bits
    on every call."""
    _require_triton(device)
    qw_out = make_weight(128, d, [4], device=device, seed=d, bias=False)
    x = _rand((M, 128), dtype, device, seed=3, scale=0.5)
    residual = _rand((M, d), dtype, device, seed=4, scale=3.0)
    # The norm's scale about 1/8 (w, or 1 + w): gate * up stays well inside float16.
    scale = (_rand((d,), torch.float32, device, seed=5, scale=0.3) + 1) / 8
    weight = (scale - 1 if unit_offset else scale).to(dtype)
    h, squares, xw, _ = _residual_sum(x, qw_out, residual, None, block, weight, unit_offset)
    qw = make_weight(d, 2 * 72, [4, 8], device=device, seed=7, perm=perm, bias=True)
    normed = rms_norm_triton(h, weight, EPS, unit_offset=unit_offset)
    unfused = quant_matmul_triton(normed, qw, path="gemv")
    if silu_mul:
        unfused = silu_mul_triton(*unfused.chunk(2, dim=-1))
    got = quant_matmul_normed(xw, squares, EPS, qw, dtype, silu_mul=silu_mul)
    assert got.dtype == dtype and got.shape == unfused.shape
    _assert_as_accurate(got, unfused, _reference(h, weight, qw, unit_offset, silu_mul))
    again = quant_matmul_normed(xw, squares, EPS, qw, dtype, silu_mul=silu_mul)
    assert torch.equal(again, got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fold_does_not_depend_on_the_chunk_of_the_squares(dtype) -> None:
    """The squares split over 4 to 32 programs finish to the same rstd (the pairwise tree),
    so the folded product has the same bits whatever the residual slot sum's block."""
    _require_triton("cpu")
    d = 1000
    qw_out = make_weight(128, d, [4], seed=21, bias=False)
    x, residual = _rand((2, 128), dtype, "cpu", 22, 0.5), _rand((2, d), dtype, "cpu", 23, 3.0)
    weight = _rand((d,), dtype, "cpu", seed=24, scale=0.3) + 1
    qw = make_weight(d, 2 * 72, [4], seed=25, bias=True)
    outs = []
    for block in (32, 64, 256):
        _, squares, xw, _ = _residual_sum(x, qw_out, residual, None, block, weight)
        assert squares.chunk == block
        outs.append(quant_matmul_normed(xw, squares, EPS, qw, dtype, silu_mul=True))
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_the_slot_sum_applies_rstd_once_and_the_bias_after(dtype, silu_mul) -> None:
    """y = rstd * (the slots' sum) + bias, on made-up slots: within a few ulps of that in
    float64, and far from the sum without rstd, with rstd twice, or with the bias scaled
    (rstd is about 1/3 here: h's rows have an rms of about 3)."""
    _require_triton("cpu")
    M, d, n, slots, chunk = 3, 320, 96, 5, 32
    h = _rand((M, d), dtype, "cpu", seed=31, scale=3.0)
    squares = RowSquares(_pairwise(h.float().view(M, d // chunk, chunk) ** 2), chunk)
    sums = _rand((slots, M, n), torch.float32, "cpu", seed=32, scale=4.0)
    bias = _rand((n,), dtype, "cpu", seed=33, scale=4.0)
    width = n // 2 if silu_mul else n
    y = torch.empty((M, width), dtype=dtype)
    launch_slot_sum(
        sums.flatten(), y, slots, silu_mul=silu_mul, norm=SlotNorm(squares, d, EPS), bias=bias
    )
    rstd = torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + EPS)
    total = sums.double().sum(0)

    def finish(scale: torch.Tensor, bias_scale: torch.Tensor | float) -> torch.Tensor:
        out = total * scale + bias.double() * bias_scale
        if silu_mul:
            gate, up = out.chunk(2, dim=-1)
            out = torch.nn.functional.silu(gate) * up
        return out

    ulp = torch.finfo(dtype).eps
    want = finish(rstd, 1.0)
    tolerance = 4 * ulp * want.abs() + 1e-3

    def close(candidate: torch.Tensor) -> bool:
        return bool(((y.double() - candidate).abs() <= tolerance).all())

    assert close(want)
    assert not close(finish(torch.ones_like(rstd), 1.0))  # rstd not applied
    assert not close(finish(rstd * rstd, 1.0))  # applied twice
    assert not close(finish(rstd, rstd))  # the bias scaled with the sum


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_public_pair_is_as_accurate_as_add_rms_norm_then_the_gemv(dtype, device) -> None:
    """quant_matmul_residual then quant_matmul_normed, leading dims kept: h as the unfused
    GEMV -> add_rms_norm, the product as accurate as rms_norm -> GEMV."""
    _require_triton(device)
    qw_o = make_weight(256, 192, [4], device=device, seed=1)
    qw_qkv = make_weight(192, 320, [4], device=device, seed=2)
    x = _rand((1, 1, 256), dtype, device, seed=6)
    residual = _rand((1, 1, 192), dtype, device, seed=8, scale=4.0)
    weight = _rand((192,), dtype, device, seed=9, scale=0.2) + 1
    normed, want_h = add_rms_norm_triton(quant_matmul_triton(x, qw_o), residual, weight, EPS)
    unfused = quant_matmul_triton(normed, qw_qkv)
    assert norm_fold_applies(x, qw_o, "out") and norm_fold_applies(want_h, qw_qkv, "in")
    h, squares, xw = quant_matmul_residual(x, qw_o, residual, weight)
    assert xw is not None and xw.shape == want_h.shape
    got = quant_matmul_normed(xw, squares, EPS, qw_qkv, dtype)
    assert h.shape == want_h.shape and torch.equal(h, want_h)
    assert got.shape == unfused.shape
    _assert_as_accurate(got, unfused, _reference(h, weight, qw_qkv, False, False))
    assert quant_matmul_residual(x, qw_o, residual)[2] is None  # no next norm: no xw


def test_the_order_of_the_squares_matters() -> None:
    """Not vacuous: summed in another order (left to right) the squares of the test rows
    give other float32 bits, and an rstd a little off changes the GEMV's output: equal bits
    above need the same tree in the slot sums."""
    _require_triton("cpu")
    dtype, d = torch.float16, 1000
    qw_out = make_weight(128, d, [4], seed=d, bias=False)
    weight = _rand((d,), dtype, "cpu", seed=5, scale=0.3) + 1
    h, squares, xw, _ = _residual_sum(
        _rand((1, 128), dtype, "cpu", 3), qw_out, _rand((1, d), dtype, "cpu", 4, 3.0), None, 32,
        weight,
    )  # fmt: skip
    left_to_right = torch.zeros((), dtype=torch.float32)
    for v in h.float()[0] ** 2:
        left_to_right = left_to_right + v
    assert not torch.equal(left_to_right, _pairwise(squares.sums)[0])
    qw = make_weight(d, 256, [4], seed=7)
    want = quant_matmul_normed(xw, squares, EPS, qw, dtype)
    off = RowSquares(squares.sums * (1 + 2.0**-14), squares.chunk)
    assert not torch.equal(quant_matmul_normed(xw, off, EPS, qw, dtype), want)


def test_what_does_not_fold_is_refused() -> None:
    qw = make_weight(64, 64, [4], seed=1)
    x = torch.zeros(3, 64, dtype=torch.float16)  # the dot path's rows
    assert not norm_fold_applies(x, qw, "in") and not norm_fold_applies(x, qw, "out")
    assert not norm_fold_applies(x[:1].float(), qw, "in")
    with pytest.raises(ValueError, match="decode GEMV"):
        quant_matmul_residual(x, qw, torch.zeros(3, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="decode GEMV"):
        quant_matmul_normed(x.float(), RowSquares(torch.zeros(3, 2), 32), EPS, qw, x.dtype)
    with pytest.raises(ValueError, match="xw must be float32"):
        quant_matmul_normed(x[:1], RowSquares(torch.zeros(1, 2), 32), EPS, qw, x.dtype)
    with pytest.raises(ValueError, match="xw must be float32"):
        quant_matmul_normed(
            x[:1].float(), RowSquares(torch.zeros(1, 2), 32), EPS, qw, torch.float32
        )
    with pytest.raises(ValueError, match="squares"):
        quant_matmul_normed(x[:1].float(), RowSquares(torch.zeros(1, 3), 32), EPS, qw, x.dtype)
    with pytest.raises(ValueError, match="norm_weight"):
        quant_matmul_residual(x[:1], qw, x[:1], torch.ones(64))  # float32 weight


def test_only_the_normed_width_is_bounded() -> None:
    """The width a norm must fit in one pass is the norm's: a Llama-3-8B gate_up (n =
    28,672, over MAX_SINGLE_PASS_D) folds the norm over its k, and a down_proj whose k is
    over it still ends in the next norm. Bounding max(k, n) kept every 8B-class model off
    the fold. Scaled down here: k 64 with n past the bound, as accurate as the unfused ops."""
    _require_triton("cpu")
    from kernels.rms_norm import MAX_SINGLE_PASS_D

    dtype, d, wide = torch.float16, 64, MAX_SINGLE_PASS_D + 128
    h = _rand((1, d), dtype, "cpu", seed=11)
    weight = _rand((d,), dtype, "cpu", seed=12, scale=0.2) + 1
    gate_up = make_weight(d, 2 * wide, [4], seed=13)
    assert norm_fold_applies(h, gate_up, "in") and not norm_fold_applies(h, gate_up, "out")
    x, o_proj = _rand((1, 32), dtype, "cpu", seed=14), make_weight(32, d, [4], seed=15)
    h_next, squares, xw = quant_matmul_residual(x, o_proj, h, weight)
    normed_h, want_h = add_rms_norm_triton(quant_matmul_triton(x, o_proj), h, weight, EPS)
    assert torch.equal(h_next, want_h)
    unfused = quant_matmul_triton(normed_h, gate_up, path="gemv")
    unfused = silu_mul_triton(*unfused.chunk(2, dim=-1))
    got = quant_matmul_normed(xw, squares, EPS, gate_up, dtype, silu_mul=True)
    _assert_as_accurate(got, unfused, _reference(h_next, weight, gate_up, False, True))
    down = make_weight(wide, d, [4], seed=16)
    assert norm_fold_applies(got[..., :wide], down, "out")
    assert not norm_fold_applies(got[..., :wide], down, "in")


def test_a_massive_channel_and_a_tiny_row_stay_exact_in_float16() -> None:
    """xw = h * w is float32: in float16 a residual channel of 20,000 under a norm weight of
    4 would overflow to inf (qkv all NaN, where rms_norm's h * rstd * w stays small), and a
    row of h ~ 1e-3 under w ~ 0.02 would fall into float16's subnormals (about 4x the
    unfused path's error). Each row as accurate as rms_norm + GEMV."""
    _require_triton("cpu")
    dtype, d = torch.float16, 256
    qw_out = make_weight(128, d, [4], seed=41, bias=False)
    x = _rand((2, 128), dtype, "cpu", seed=42, scale=0.01)
    x[1] = 0  # row 1's h is its residual
    residual = _rand((2, d), dtype, "cpu", seed=43)
    residual[0, 7] = 20000.0  # a massive activation, as a few channels of Llama models carry
    residual[1] = residual[1] * 1e-3
    weight = _rand((d,), dtype, "cpu", seed=44, scale=0.002) + 0.02
    weight[7] = 4.0
    h, squares, xw, _ = _residual_sum(x, qw_out, residual, None, 32, weight)
    assert xw.dtype == torch.float32 and torch.equal(xw, h.float() * weight.float())
    qw = make_weight(d, 2 * 72, [4], seed=45, bias=True)
    unfused = quant_matmul_triton(rms_norm_triton(h, weight, EPS), qw, path="gemv")
    got = quant_matmul_normed(xw, squares, EPS, qw, dtype)
    ref = _reference(h, weight, qw, False, False)
    for row in range(2):
        assert torch.isfinite(got[row]).all()
        _assert_as_accurate(got[row], unfused[row], ref[row])
