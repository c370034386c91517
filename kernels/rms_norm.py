"""RMSNorm over the last dimension.

Contract (x [..., D] in float32/float16/bfloat16, weight [D], any leading shape):

    x32 = x.float()
    y = x32 * rsqrt(mean(x32**2, -1) + eps)
    unit_offset=False (Llama):  weight * y.to(x.dtype)      # dtype: promote(x, weight)
    unit_offset=True  (Gemma):  (y * (1 + weight.float())).to(x.dtype)

These are the cast orders of transformers' LlamaRMSNorm and GemmaRMSNorm. The Triton kernel
repeats them step for step: it rounds y to x.dtype before the weight multiply, and that
multiply of two 16-bit floats is exact in float32, so its outputs differ from the reference
only where rsqrt or the row sum round differently (a few float32 ulps before the final cast).

The row's sum of squares is a fixed pairwise tree (`pairwise_sum`: the row zero-padded to a
power of two, adjacent pairs added level by level), not tl.sum, whose order depends on the
register layout. A tree has aligned subtrees at every level, so the sum can be split over
programs and still give the same bits: the decode GEMV's residual slot sum writes each
chunk's subtree (kernels/quant_matmul/slot_sum.py, `launch_slot_sum_residual`) and the next
GEMV's slot sum finishes the tree into this kernel's rstd, bit for bit, in every program
alike (issue 28).
The squares of 16-bit values are exact in float32, so whether a compiler contracts a square
into the first add (an FMA) does not change the bits either.

`add_rms_norm(x, residual, ...)` is a pre-norm block's residual add fused with the next norm:
it returns (rms_norm(residual + x), residual + x), the sum rounded to x.dtype before the norm
reads it, exactly as the two separate ops compute it. The same kernel serves both (the add is
a constexpr branch), so its normed rows equal `rms_norm`'s bit for bit on either path.

Both dispatch: Triton on CUDA tensors, the reference otherwise (see kernels.backend).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import (
    Backend,
    cast_rtne,
    device_guard,
    is_interpreted,
    pdl_start,
    programmatic_launch,
    resolve_backend,
)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Rows up to this many elements are held in registers (one read of x); longer rows loop over
# D twice (sum of squares, then scale) and read x twice. 16384 covers every common hidden
# size, including Llama-3-405B's.
MAX_SINGLE_PASS_D = 16384


def _check_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be a floating tensor, got {weight.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, unit_offset: bool) -> torch.dtype:
    # Llama multiplies after the cast, so torch type promotion decides the result dtype.
    return x.dtype if unit_offset else torch.promote_types(x.dtype, weight.dtype)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False
) -> torch.Tensor:
    """RMSNorm in plain torch, with transformers' cast order (see the module docstring)."""
    _check_args(x, weight)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (y * (1.0 + weight.float())).to(x.dtype)
    return weight * y.to(x.dtype)


@triton.jit
def pairwise_sum(v, N: tl.constexpr):
    """The sum of v [N] (float32, N a power of two, at most 2^14) as a fixed tree: adjacent
    pairs added, level by level, down to one value. Each add has two operands, so no register
    layout or reduction order can change the bits; subtree j of size 2^l is elements [j 2^l,
    (j + 1) 2^l), so chunks summed apart (one program each) finish to the same value. Zeros
    appended to v change nothing (x + 0 = x).

    How: v is reshaped once to [1, 2, ..., 2] (row-major, so the last axis is bit 0 of the
    flat index) and the last size-2 axis is summed log2(N) times: level l adds the pairs
    of level l - 1. Splitting the row at every level instead (tl.split of [N >> l, 2])
    compiled to a copy of the whole row into every thread through shared memory and all
    N - 1 adds in each (4,096 instructions per thread for a 4,096 row on sm_90, against 408
    this way, the size of a plain tl.sum)."""

    if N == 1:
        t = tl.reshape(v, [1])
    elif N == 2:
        t = tl.reshape(v, [1, 2])
    elif N == 4:
        t = tl.reshape(v, [1, 2, 2])
    elif N == 8:
        t = tl.reshape(v, [1, 2, 2, 2])
    elif N == 16:
        t = tl.reshape(v, [1, 2, 2, 2, 2])
    elif N == 32:
        t = tl.reshape(v, [1, 2, 2, 2, 2, 2])
    elif N == 64:
        t = tl.reshape(v, [1, 2, 2, 2, 2, 2, 2])
    elif N == 128:
        t = tl.reshape(v, [1, 2, 2, 2, 2, 2, 2, 2])
    elif N == 256:
        t = tl.reshape(v, [1, 2, 2, 2, 2, 2, 2, 2, 2])
    elif N == 512:
        t = tl.reshape(v, [1, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    elif N == 1024:
        t = tl.reshape(v, [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    elif N == 2048:
        t = tl.reshape(v, [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    elif N == 4096:
        t = tl.reshape(v, [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    elif N == 8192:
        t = tl.reshape(v, [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    elif N == 16384:
        t = tl.reshape(v, [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    else:
        tl.static_assert(False, "pairwise_sum: N must be a power of two up to 2^14")
    for level in tl.static_range(1, 15):
        if (N >> level) >= 1:
            t = tl.sum(t, axis=len(t.shape) - 1)
    return tl.sum(t, axis=0)  # one element: exact


@triton.jit
def rms_rstd(sum_of_squares, D, eps):
    """1 / sqrt(mean of squares + eps) from the row's pairwise sum; D a run-time integer in
    every caller (a constant divisor could be folded into a multiply: other bits)."""
    return tl.rsqrt(sum_of_squares / D + eps)


@triton.jit
def rms_norm_scale(
    x, w, rstd, x_dtype: tl.constexpr, UNIT_OFFSET: tl.constexpr, EMULATE_BF16: tl.constexpr
):
    """The norm's output for x (float32, rounded to x_dtype) and weight w (float32) before
    its final cast: the module docstring's cast orders. Shared with
    kernels/tp_all_reduce.py's fused norm (through rms_norm_row), so both round alike."""
    y = x * rstd
    if UNIT_OFFSET:
        out = y * (1.0 + w)
    else:
        out = w * cast_rtne(y, x_dtype, EMULATE_BF16).to(tl.float32)
    return out


@triton.jit
def rms_norm_row(
    x,
    w,
    D,
    eps,
    x_dtype: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The norm of one row held in registers: x [BLOCK_D] float32 (the row's values, already
    rounded to `x_dtype`; 0 past D), w the weight as float32. Returns the float32 output
    before its cast. Shared with kernels/tp_all_reduce.py, whose fused norm must give the
    same bits as this kernel's (same code; the pairwise sum does not depend on warps)."""
    rstd = rms_rstd(pairwise_sum(x * x, BLOCK_D), D, eps)
    return rms_norm_scale(x, w, rstd, x_dtype, UNIT_OFFSET, EMULATE_BF16)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,  # HAS_RESIDUAL: the stream x is added to; else unused (x again)
    weight_ptr,
    out_ptr,
    residual_out_ptr,  # HAS_RESIDUAL: where residual + x goes; else unused (out again)
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    residual_out_row_stride,
    D,
    eps,
    UNIT_OFFSET: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels.backend)
):
    # Everything this kernel reads comes from earlier kernels: wait before any load.
    pdl_start(USE_PDL)
    # One program per row. int64 row offsets: rows * stride passes 2**31 in long prefills.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    residual_row = residual_ptr + row * residual_row_stride
    out_row = out_ptr + row * out_row_stride
    residual_out_row = residual_out_ptr + row * residual_out_row_stride
    x_dtype = x_ptr.dtype.element_ty
    out_dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_D)

    if SINGLE_PASS:
        mask = cols < D
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            # The sum is rounded to the activation dtype before the norm reads it, as the
            # unfused path's torch add stores it: both outputs match that path bit for bit.
            summed = cast_rtne(
                x + tl.load(residual_row + cols, mask=mask, other=0.0).to(tl.float32),
                x_dtype,
                EMULATE_BF16,
            )
            tl.store(residual_out_row + cols, summed, mask=mask)
            x = summed.to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = rms_norm_row(x, w, D, eps, x_dtype, UNIT_OFFSET, EMULATE_BF16, BLOCK_D)
        tl.store(out_row + cols, cast_rtne(out, out_dtype, EMULATE_BF16), mask=mask)
    else:
        # Per-lane partial sums, reduced once at the end: fewer cross-warp reductions.
        # The trip count is a constexpr, not range(0, D, BLOCK_D): Triton 3.6's interpreter
        # fails on runtime loop bounds under numpy >= 2.4 (triton-lang/triton#9171).
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for block in range(N_BLOCKS):
            start = block * BLOCK_D
            mask = start + cols < D
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(residual_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                summed = cast_rtne(x + r, x_dtype, EMULATE_BF16)
                tl.store(residual_out_row + start + cols, summed, mask=mask)
                x = summed.to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / D + eps)
        for block in range(N_BLOCKS):
            start = block * BLOCK_D
            mask = start + cols < D
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                # Recomputed from the inputs (never aliased to residual_out), not read back
                # from residual_out: no ordering question between this program's stores
                # and loads.
                r = tl.load(residual_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                x = cast_rtne(x + r, x_dtype, EMULATE_BF16).to(tl.float32)
            w = tl.load(weight_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = x * rstd
            if UNIT_OFFSET:
                out = y * (1.0 + w)
            else:
                out = w * cast_rtne(y, x_dtype, EMULATE_BF16).to(tl.float32)
            tl.store(out_row + start + cols, cast_rtne(out, out_dtype, EMULATE_BF16), mask=mask)


# Triton 3.6's interpreter truncates float32 -> bfloat16: see kernels.backend.cast_rtne.
_INTERPRETED = is_interpreted(_rms_norm_kernel)


def norm_num_warps(block_d: int) -> int:
    """Warps for a norm program over rows of block_d elements (kernels/tp_all_reduce.py
    launches its fused norm with the same, so both give the same bits).

    About 16 row elements per thread (32 for the widest single-pass rows): the row stays in
    registers without spills, and short rows don't leave most of a program's threads idle."""
    return max(1, min(16, block_d // 512))


def _launch(
    x2d: torch.Tensor,
    residual2d: torch.Tensor | None,
    weight: torch.Tensor,
    out2d: torch.Tensor,
    residual_out2d: torch.Tensor | None,
    eps: float,
    unit_offset: bool,
) -> None:
    # x2d [N, D] (and residual2d) with unit last-dim stride; rows may be strided.
    D = x2d.shape[1]
    single_pass = D <= MAX_SINGLE_PASS_D
    block_d = triton.next_power_of_2(D) if single_pass else 4096
    has_residual = residual2d is not None
    # Without a residual the kernel never touches those pointers; pass x and out again.
    residual2d = residual2d if residual2d is not None else x2d
    residual_out2d = residual_out2d if residual_out2d is not None else out2d
    pdl = programmatic_launch(x2d)
    with device_guard(x2d):
        _rms_norm_kernel[(x2d.shape[0],)](
            x2d,
            residual2d,
            weight,
            out2d,
            residual_out2d,
            x2d.stride(0),
            residual2d.stride(0),
            out2d.stride(0),
            residual_out2d.stride(0),
            D,
            float(eps),
            UNIT_OFFSET=unit_offset,
            HAS_RESIDUAL=has_residual,
            SINGLE_PASS=single_pass,
            BLOCK_D=block_d,
            N_BLOCKS=triton.cdiv(D, block_d),
            EMULATE_BF16=_INTERPRETED,
            num_warps=norm_num_warps(block_d),
            USE_PDL=pdl,
            launch_pdl=pdl,
        )


def _rows(t: torch.Tensor) -> torch.Tensor:
    # [N, D]; a view where possible (rows may be strided), the last dim made dense.
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False
) -> torch.Tensor:
    """RMSNorm through the Triton kernel; same contract as `rms_norm_reference`."""
    _check_args(x, weight)
    D = x.shape[-1]
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight, unit_offset), device=x.device)
    if x.numel() == 0:
        return out
    _launch(_rows(x), None, weight.contiguous(), out.view(-1, D), None, eps, unit_offset)
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor:
    """RMSNorm of x [..., D] with weight [D]; Triton on CUDA, the torch reference otherwise."""
    if resolve_backend(backend, x, weight) == "triton":
        return rms_norm_triton(x, weight, eps, unit_offset=unit_offset)
    return rms_norm_reference(x, weight, eps, unit_offset=unit_offset)


# ---------------------------------------------------------------------------------------------
# Residual add + RMSNorm: the pre-norm block's `h = h + f(norm(h))` followed by the next
# norm, in one launch that reads x and the residual once and writes the sum and its norm.


def _check_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    _check_args(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x ({x.dtype} {tuple(x.shape)}), got {residual.dtype} "
            f"{tuple(residual.shape)}"
        )


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) in plain torch: the unfused path itself."""
    _check_residual(x, residual, weight)
    summed = residual + x  # rounded to x.dtype here, and the norm reads the rounded sum
    return rms_norm_reference(summed, weight, eps, unit_offset=unit_offset), summed


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm in one Triton launch; same contract as the reference.

    Out of place: the inputs are left as they are (a caller may still hold them) and both
    outputs are new contiguous tensors. The norm is the same kernel code as `rms_norm`, so
    the normed rows equal `rms_norm_triton(residual + x)` bit for bit.
    """
    _check_residual(x, residual, weight)
    D = x.shape[-1]
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight, unit_offset), device=x.device)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out, summed
    _launch(
        _rows(x),
        _rows(residual),
        weight.contiguous(),
        out.view(-1, D),
        summed.view(-1, D),
        eps,
        unit_offset,
    )
    return out, summed


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) for x, residual [..., D] of one dtype.

    The sum is rounded to x.dtype before the norm reads it, as separate ops would round it.
    Triton on CUDA (one launch), the torch reference otherwise.
    """
    if resolve_backend(backend, x, residual, weight) == "triton":
        return add_rms_norm_triton(x, residual, weight, eps, unit_offset=unit_offset)
    return add_rms_norm_reference(x, residual, weight, eps, unit_offset=unit_offset)
