"""RMSNorm folded into the decode GEMVs around it (issue 28): a pre-norm block's o_proj or
down_proj ends in the next norm's residual add and partial sums of squares
(`quant_matmul_residual`), and the GEMV after the norm (qkv, gate_up) applies the norm to
x as it loads it (`quant_matmul_normed`). Together they replace kernels.add_rms_norm's
launch with the same bits: h as add_rms_norm's residual output, the product as
kernels.rms_norm followed by the GEMV (kernels/rms_norm.py's pairwise sum of squares is
what lets the sum be split over programs).

Only the decode GEMV's path (Triton, at most GEMV_MAX_M rows, float16/bfloat16, rows the
norm holds in registers) folds: `norm_fold_applies`; callers run the unfused ops otherwise.
"""

from __future__ import annotations

from typing import Literal

import torch

from kernels.backend import device_guard
from kernels.quant_matmul.gemv import GemvNorm, launch_gemv, launch_gemv_residual
from kernels.quant_matmul.layout import QuantizedWeight
from kernels.quant_matmul.paths import GEMV_MAX_M, check_args
from kernels.quant_matmul.slot_sum import RowSquares
from kernels.quant_matmul.split_k import unit_col_stride
from kernels.rms_norm import MAX_SINGLE_PASS_D


def norm_fold_applies(x: torch.Tensor, qw: QuantizedWeight, side: Literal["in", "out"]) -> bool:
    """Whether x [..., k] @ W runs on the decode GEMV with a norm folded in on its input
    (side "in": quant_matmul_normed, the norm over k) or out of its output (side "out":
    quant_matmul_residual, the norm over n): float16/bfloat16, at most GEMV_MAX_M rows, and
    the norm's width one that a single pass holds. Only the normed width is bounded: an
    8B model's gate_up (n = 28,672) folds the norm over its k = 4,096. These are Triton
    kernels (CUDA tensors, or the interpreter's): callers check the device."""
    rows = x.numel() // max(x.shape[-1], 1)
    width = qw.in_features if side == "in" else qw.out_features
    return (
        x.dtype in (torch.float16, torch.bfloat16)
        and 0 < rows <= GEMV_MAX_M
        and width <= MAX_SINGLE_PASS_D
    )


def quant_matmul_residual(
    x: torch.Tensor, qw: QuantizedWeight, residual: torch.Tensor
) -> tuple[torch.Tensor, RowSquares]:
    """(h, its RowSquares): h = residual + (x @ W + bias rounded to x's dtype), rounded, the
    bits of `kernels.add_rms_norm(quant_matmul(x, qw), residual)[1]`. x [..., k], residual
    [..., n] of x's dtype; `norm_fold_applies(x, qw, "out")` must hold."""
    check_args(x, qw)
    if not norm_fold_applies(x, qw, "out"):
        raise ValueError("quant_matmul_residual runs on the decode GEMV only (norm_fold_applies)")
    n = qw.out_features
    if residual.shape != (*x.shape[:-1], n) or residual.dtype != x.dtype:
        raise ValueError(f"residual must be {x.dtype} {(*x.shape[:-1], n)}")
    x2d = unit_col_stride(x.reshape(-1, qw.in_features))
    h = torch.empty((x2d.shape[0], n), dtype=x.dtype, device=x.device)
    with device_guard(x):
        squares = launch_gemv_residual(x2d, qw, residual.reshape(-1, n).contiguous(), h)
    return h.view(*x.shape[:-1], n), squares


def quant_matmul_normed(
    h: torch.Tensor,
    squares: RowSquares,
    weight: torch.Tensor,
    eps: float,
    qw: QuantizedWeight,
    *,
    unit_offset: bool = False,
    silu_mul: bool = False,
) -> torch.Tensor:
    """rms_norm(h, weight, eps, unit_offset) @ W + bias in one GEMV, the bits of the two
    ops (h's rstd from `squares`, which quant_matmul_residual returned with h). `silu_mul`:
    W is a fused [gate | up] projection and the result is silu(gate) * up, as
    kernels.quant_matmul_silu_mul. `norm_fold_applies(h, qw, "in")` must hold."""
    check_args(h, qw)
    if not norm_fold_applies(h, qw, "in"):
        raise ValueError("quant_matmul_normed runs on the decode GEMV only (norm_fold_applies)")
    n = qw.out_features
    if silu_mul and n % 2:
        raise ValueError(f"a [gate | up] projection has an even out_features, got {n}")
    x2d = unit_col_stride(h.reshape(-1, qw.in_features))
    width = n // 2 if silu_mul else n
    y = torch.empty((x2d.shape[0], width), dtype=h.dtype, device=h.device)
    norm = GemvNorm(weight.contiguous(), float(eps), unit_offset, squares)
    with device_guard(h):
        launch_gemv(x2d, qw, y, silu_mul=silu_mul, norm=norm)
    return y.view(*h.shape[:-1], width)
