"""Dequantization of the runtime layout into a dense W, and the prefill path built on it:
dequantize + cuBLAS (`dequant_matmul`, for many rows of x, in column chunks of at most
DEQUANT_SCRATCH_MAX_BYTES).

    dequantize_triton(qw, *, dtype=float16, permuted=False, cols=None) -> W [k, n] in dtype,
        original row order (as dequantize_reference) unless permuted=True
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import cast_rtne, device_guard, is_interpreted
from kernels.quant_matmul.layout import QuantizedWeight, per_group_zeros
from kernels.quant_matmul.paths import DTYPES
from kernels.quant_matmul.split_k import plane_args, plane_meta
from kernels.quant_matmul.tiles import segment_codes_2d, zero_points

# Dequantization tile (elementwise: stores dominate).
_DEQUANT_BLOCK_K = 32
_DEQUANT_BLOCK_N = 128
_DEQUANT_NUM_WARPS = 4
# The most bytes of dense weight the dequantize + cuBLAS path writes at once. A larger
# linear is dequantized and multiplied in column chunks: a 70B model's fused gate/up would
# take 0.94 GB of fp16 scratch in one piece (and as much again in the prompt graphs' pool),
# in chunks of 8192 x 16384 it takes 256 MiB, and each chunk is still a large matmul. The
# 8B model's linears (at most 235 MB) stay whole.
DEQUANT_SCRATCH_MAX_BYTES = 256 << 20


@triton.jit
def _dequant_kernel(
    out_ptr,  # [k, n]
    p0_ptr,
    p1_ptr,
    scales_ptr,
    zeros_ptr,
    row_group_ptr,
    perm_ptr,
    n,
    out_stride,
    p0_stride,
    p1_stride,
    sz_stride,
    row_start,
    seg_rows,
    SCATTER: tl.constexpr,  # write permuted row i to its original row perm[i]
    ZERO_PER_GROUP: tl.constexpr,  # zeros hold one zero point per group (per_group_zeros)
    NUM_PLANES: tl.constexpr,
    P0_BITS: tl.constexpr,
    P0_SHIFT: tl.constexpr,
    P1_BITS: tl.constexpr,
    P1_SHIFT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < seg_rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < n)[None, :]
    codes = segment_codes_2d(
        p0_ptr,
        p0_stride,
        p1_ptr,
        p1_stride,
        rows[:, None],
        cols[None, :],
        mask,
        NUM_PLANES,
        P0_BITS,
        P0_SHIFT,
        P1_BITS,
        P1_SHIFT,
    )
    group = tl.load(row_group_ptr + row_start + rows, mask=row_ok, other=0)
    sz_offsets = group[:, None] * sz_stride + cols[None, :]
    scale = tl.load(scales_ptr + sz_offsets, mask=mask, other=0.0).to(tl.float32)
    zero = zero_points(zeros_ptr, group[:, None], sz_offsets, mask, ZERO_PER_GROUP)
    # (code - zero) * scale is exact in float32 (9 x 11 significant bits): one rounding at
    # the final cast, like the reference's float32 math.
    w = (codes.to(tl.float32) - zero) * scale
    if SCATTER:
        out_rows = tl.load(perm_ptr + row_start + rows, mask=row_ok, other=0)
    else:
        out_rows = row_start + rows
    out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_ptrs, cast_rtne(w, out_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


# Triton 3.6's interpreter truncates float32 -> bfloat16: see kernels.backend.cast_rtne.
_INTERPRETED = is_interpreted(_dequant_kernel)


def dequantize_triton(
    qw: QuantizedWeight,
    *,
    dtype: torch.dtype = torch.float16,
    permuted: bool = False,
    cols: tuple[int, int] | None = None,
) -> torch.Tensor:
    """W [k, n] in `dtype`: original row order by default (as `dequantize_reference`, so
    y = x @ W + bias), or permuted order (row i is the kernel's row i) with permuted=True.
    `cols` (start, end): only those output columns, W[:, start:end].

    Computed in float32 and rounded once (round to nearest even) to `dtype`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    k = qw.in_features
    c0, c1 = cols if cols is not None else (0, qw.out_features)
    if not 0 <= c0 <= c1 <= qw.out_features:
        raise ValueError(f"cols {cols} are not a range of the {qw.out_features} columns")
    n = c1 - c0
    out = torch.empty((k, n), dtype=dtype, device=qw.scales.device)
    if k == 0 or n == 0:
        return out
    perm = qw.perm if qw.perm is not None else qw.row_group
    # Column views: the kernel indexes columns from each view's start, with its row stride.
    # Zero points kept one per group (strides (1, 0)) stay the same view.
    scales, zeros = qw.scales[:, c0:c1], qw.zeros[:, c0:c1]
    with device_guard(out):
        for segment in qw.segments:
            seg_rows = segment.row_end - segment.row_start
            if seg_rows <= 0:
                continue
            p0, p1, p0_stride, p1_stride = plane_args(segment, c0, c1)
            grid = (triton.cdiv(seg_rows, _DEQUANT_BLOCK_K), triton.cdiv(n, _DEQUANT_BLOCK_N))
            _dequant_kernel[grid](
                out,
                p0,
                p1,
                scales,
                zeros,
                qw.row_group,
                perm,
                n,
                out.stride(0),
                p0_stride,
                p1_stride,
                scales.stride(0),
                segment.row_start,
                seg_rows,
                SCATTER=qw.perm is not None and not permuted,
                ZERO_PER_GROUP=per_group_zeros(qw.zeros),
                **plane_meta(segment),
                EMULATE_BF16=_INTERPRETED,
                BLOCK_K=_DEQUANT_BLOCK_K,
                BLOCK_N=_DEQUANT_BLOCK_N,
                num_warps=_DEQUANT_NUM_WARPS,
            )
    return out


def dequant_chunk_columns(k: int, n: int, itemsize: int) -> int:
    """Columns per dense chunk of the dequantize + cuBLAS path: all n when W [k, n] fits
    DEQUANT_SCRATCH_MAX_BYTES, else the most whole dequantization tiles that do (one at
    least)."""
    if k * n * itemsize <= DEQUANT_SCRATCH_MAX_BYTES:
        return n
    tiles = DEQUANT_SCRATCH_MAX_BYTES // (k * itemsize * _DEQUANT_BLOCK_N)
    return max(tiles, 1) * _DEQUANT_BLOCK_N


def dequant_matmul(x2d: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x2d @ W + bias through dense W in x's dtype, in column chunks (see
    DEQUANT_SCRATCH_MAX_BYTES). W comes in the original row order: x needs no gather."""
    n = qw.out_features
    step = dequant_chunk_columns(qw.in_features, n, x2d.element_size())
    bias = None if qw.bias is None else qw.bias.to(x2d.dtype)
    if step >= n:
        w = dequantize_triton(qw, dtype=x2d.dtype)
        return x2d @ w if bias is None else torch.addmm(bias, x2d, w)
    out = torch.empty((x2d.shape[0], n), dtype=x2d.dtype, device=x2d.device)
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        w = dequantize_triton(qw, dtype=x2d.dtype, cols=(c0, c1))
        # A column slice of the row-major output is a valid cuBLAS operand (its row
        # stride is n): the product is written in place.
        if bias is None:
            torch.mm(x2d, w, out=out[:, c0:c1])
        else:
            torch.addmm(bias[c0:c1], x2d, w, out=out[:, c0:c1])
        del w  # the next chunk reuses this one's memory
    return out
