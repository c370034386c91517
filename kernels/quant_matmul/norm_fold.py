"""RMSNorm folded into the decode GEMVs around it (issue 28). RMSNorm is h * rstd * w (Gemma:
h * rstd * (1 + w)) with rstd one scalar per row, and a GEMV is linear in x, so
rms_norm(h) @ W + b = rstd * ((h * w) @ W) + b. A pre-norm block's o_proj or down_proj ends
in the next norm's residual add, its partial sums of squares and xw = h * w
(`quant_matmul_residual`, all in its slot sum); the GEMV after the norm (qkv, gate_up)
reads xw as a plain x and its slot sum applies rstd once per output, then the bias
(`quant_matmul_normed`). add_rms_norm's launch is gone and the GEMV does no norm work
(kernels/quant_matmul/gemv.py's docstring says why that matters). h is add_rms_norm's
residual output bit for bit; the product is not rms_norm + GEMV's bits (one rounding of
h * w to the dtype instead of one of h * rstd * w) but as accurate, and the same bits every
run: every sum has a fixed order (kernels/rms_norm.py's pairwise tree splits the sum of
squares over programs).

Only the decode GEMV's path (Triton, at most GEMV_MAX_M rows, float16/bfloat16, rows the
norm holds in registers) folds: `norm_fold_applies`; callers run the unfused ops otherwise.
"""

from __future__ import annotations

from typing import Literal

import torch

from kernels.backend import device_guard
from kernels.quant_matmul.gemv import launch_gemv, launch_gemv_residual, launch_gemv_to_slots
from kernels.quant_matmul.layout import QuantizedWeight
from kernels.quant_matmul.paths import GEMV_MAX_M, check_args
from kernels.quant_matmul.slot_sum import RowSquares, SlotNorm
from kernels.quant_matmul.slot_sum_rope import RopeCacheWrite, launch_slot_sum_rope
from kernels.quant_matmul.split_k import unit_col_stride
from kernels.rms_norm import MAX_SINGLE_PASS_D


def norm_fold_applies(
    x: torch.Tensor,
    qw: QuantizedWeight,
    side: Literal["in", "out"],
    dtype: torch.dtype | None = None,
) -> bool:
    """Whether x [..., k] @ W runs on the decode GEMV with a norm folded in on its input
    (side "in": quant_matmul_normed, the norm over k) or out of its output (side "out":
    quant_matmul_residual, the norm over n): the model's dtype (`dtype`, default x's; the
    folded GEMV's x is float32) float16/bfloat16, at most GEMV_MAX_M rows, and
    the norm's width one that a single pass holds. Only the normed width is bounded: an
    8B model's gate_up (n = 28,672) folds the norm over its k = 4,096. These are Triton
    kernels (CUDA tensors, or the interpreter's): callers check the device."""
    rows = x.numel() // max(x.shape[-1], 1)
    width = qw.in_features if side == "in" else qw.out_features
    return (
        (dtype if dtype is not None else x.dtype) in (torch.float16, torch.bfloat16)
        and 0 < rows <= GEMV_MAX_M
        and width <= MAX_SINGLE_PASS_D
    )


def quant_matmul_residual(
    x: torch.Tensor,
    qw: QuantizedWeight,
    residual: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    *,
    unit_offset: bool = False,
    x_in_row_order: bool = False,
    xw_scatter: torch.Tensor | None = None,
) -> tuple[torch.Tensor, RowSquares, torch.Tensor | None]:
    """(h, its RowSquares, xw): h = residual + (x @ W + bias rounded to x's dtype), rounded,
    the bits of `kernels.add_rms_norm(quant_matmul(x, qw), residual)[1]`; with the next
    norm's `norm_weight` w ([n], x's dtype) xw = h * w (h * (1 + w) with `unit_offset`)
    in float32 (exact), the x of `quant_matmul_normed`, else None. x [..., k], residual
    [..., n] of x's dtype; `norm_fold_applies(x, qw, "out")` must hold. `x_in_row_order`:
    x is x[..., perm] already (no gather: kernels/quant_matmul/slot_sum.py's docstring);
    `xw_scatter` (the next GEMV's split_k.row_order): xw is stored in that GEMV's row order,
    for `quant_matmul_normed(..., x_in_row_order=True)`."""
    check_args(x, qw)
    if not norm_fold_applies(x, qw, "out"):
        raise ValueError("quant_matmul_residual runs on the decode GEMV only (norm_fold_applies)")
    n = qw.out_features
    if residual.shape != (*x.shape[:-1], n) or residual.dtype != x.dtype:
        raise ValueError(f"residual must be {x.dtype} {(*x.shape[:-1], n)}")
    x2d = unit_col_stride(x.reshape(-1, qw.in_features))
    h = torch.empty((x2d.shape[0], n), dtype=x.dtype, device=x.device)
    xw = None
    if norm_weight is not None:
        xw = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    weight = norm_weight.contiguous() if norm_weight is not None else None
    with device_guard(x):
        squares = launch_gemv_residual(
            x2d,
            qw,
            residual.reshape(-1, n).contiguous(),
            h,
            norm_weight=weight,
            unit_offset=unit_offset,
            xw=xw,
            xw_scatter=xw_scatter,
            x_in_row_order=x_in_row_order,
        )
    shape = (*x.shape[:-1], n)
    return h.view(shape), squares, xw.view(shape) if xw is not None else None


def _check_normed(xw: torch.Tensor, qw: QuantizedWeight, dtype: torch.dtype) -> None:
    """The inputs of a GEMV after a folded norm: xw float32, the model's dtype 16-bit, the
    decode GEMV's shapes (norm_fold_applies)."""
    check_args(xw, qw)
    if xw.dtype != torch.float32 or dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"xw must be float32 and dtype float16/bfloat16, got {xw.dtype}, {dtype}")
    if not norm_fold_applies(xw, qw, "in", dtype):
        raise ValueError("the GEMV after a folded norm runs on the decode GEMV only")


def quant_matmul_normed(
    xw: torch.Tensor,
    squares: RowSquares,
    eps: float,
    qw: QuantizedWeight,
    dtype: torch.dtype,
    *,
    silu_mul: bool = False,
    x_in_row_order: bool = False,
    scatter: torch.Tensor | None = None,
) -> torch.Tensor:
    """rms_norm(h, w, eps) @ W + bias as rstd * (xw @ W) + bias: xw = h * w and `squares`
    h's, both from quant_matmul_residual (the norm's unit offset is in xw). The GEMV reads
    xw as any x; its slot sum scales each row's sums by the row's rstd (finished from the
    squares by rms_norm's pairwise tree) and then adds the bias, rounding once to `dtype`
    (h's). Not rms_norm + GEMV's bits (xw is float32, where rms_norm's output is rounded to
    h's dtype), the same bits every run. `silu_mul`: W is
    a fused [gate | up] projection and the result is silu(gate) * up, as
    kernels.quant_matmul_silu_mul. `norm_fold_applies(xw, qw, "in")` must hold.
    `x_in_row_order`: xw is in W's row order (quant_matmul_residual's xw_scatter);
    `scatter`: the result's column c is stored at column scatter[c] (the next GEMV's
    split_k.row_order, for quant_matmul_residual(..., x_in_row_order=True))."""
    _check_normed(xw, qw, dtype)
    n = qw.out_features
    if silu_mul and n % 2:
        raise ValueError(f"a [gate | up] projection has an even out_features, got {n}")
    x2d = unit_col_stride(xw.reshape(-1, qw.in_features))
    width = n // 2 if silu_mul else n
    y = torch.empty((x2d.shape[0], width), dtype=dtype, device=xw.device)
    norm = SlotNorm(squares, qw.in_features, float(eps))
    with device_guard(xw):
        launch_gemv(
            x2d,
            qw,
            y,
            silu_mul=silu_mul,
            norm=norm,
            x_in_row_order=x_in_row_order,
            scatter=scatter,
        )
    return y.view(*xw.shape[:-1], width)


def quant_matmul_normed_rope(
    xw: torch.Tensor,
    squares: RowSquares,
    eps: float,
    qw: QuantizedWeight,
    dtype: torch.dtype,
    rope: RopeCacheWrite,
    *,
    x_in_row_order: bool = False,
) -> torch.Tensor:
    """A fused qkv projection after a folded norm, with RoPE and the native cache write in
    its slot sum (kernels/quant_matmul/slot_sum_rope.py): returns the rotated q [T, Hq, D]
    and stores the rotated k and v at rope.slots of rope's caches. The bits of
    `quant_matmul_normed` followed by kernels.apply_rope_write, one launch and the qkv
    tensor fewer. qw's out_features must be rope.width; `norm_fold_applies(xw, qw, "in",
    dtype)` must hold. `x_in_row_order` as for `quant_matmul_normed`."""
    _check_normed(xw, qw, dtype)
    if qw.out_features != rope.width:
        raise ValueError(
            f"a qkv projection of {rope.num_heads} + 2 x {rope.num_kv_heads} heads of "
            f"{rope.head_dim} has {rope.width} outputs, got {qw.out_features}"
        )
    x2d = unit_col_stride(xw.reshape(-1, qw.in_features))
    q = torch.empty((x2d.shape[0], rope.num_heads, rope.head_dim), dtype=dtype, device=xw.device)
    norm = SlotNorm(squares, qw.in_features, float(eps))
    with device_guard(xw):
        sums, slots = launch_gemv_to_slots(x2d, qw, add_bias=False, x_in_row_order=x_in_row_order)
        launch_slot_sum_rope(sums, slots, rope, q, norm=norm, bias=qw.bias)
    return q
