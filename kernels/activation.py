"""SiLU-gated product, the middle of a SwiGLU MLP: silu(gate) * up in one pass.

Contract (gate, up [..., I] of one shape and dtype, float32/float16/bfloat16; rows may be
strided, e.g. the two halves of a fused gate_up projection's [T, 2I] output):

    silu_mul(gate, up) = F.silu(gate) * up        # a new contiguous tensor in that dtype

with torch's roundings: F.silu computes x / (1 + exp(-x)) in float32 and rounds it to the
activation dtype, then the product is rounded once more. The Triton kernel rounds at the same
two places. On a GPU it takes exp from libdevice (`expf`, what torch's CUDA silu calls; the
fast `tl.exp` is an approximate ex2) and an IEEE-rounded division (`/` in Triton is an
approximate one), so it matches torch's CUDA silu and multiply bit for bit. The interpreter
has no libdevice and uses numpy's exp: there results may differ from torch's CPU silu by an
ulp of float32 before the final rounding.

Why a kernel: at batch 1 the two torch ops are two ~2 us launches per layer (64 of an 8B
model's decode step) on a few KiB each; this is one.

`silu_mul` dispatches: Triton on CUDA tensors, the reference otherwise (see kernels.backend).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

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

# Columns per program: 8 elements per thread at 4 warps. A decode row of Llama-3-8B
# (I = 14336) spreads over 14 programs.
_BLOCK = 1024


def _check_args(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.dtype not in _DTYPES or up.dtype != gate.dtype:
        raise ValueError(
            f"gate and up must share one of float32/float16/bfloat16, got {gate.dtype} and "
            f"{up.dtype}"
        )
    if gate.shape != up.shape or gate.dim() == 0:
        raise ValueError(
            f"gate and up must have one shape [..., I], got {tuple(gate.shape)} and "
            f"{tuple(up.shape)}"
        )


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up in plain torch: the unfused MLP's two ops."""
    _check_args(gate, up)
    return F.silu(gate) * up


@triton.jit
def silu_mul_rounded(
    gate, up, dtype: tl.constexpr, PRECISE_EXP: tl.constexpr, EMULATE_BF16: tl.constexpr
):
    """silu(gate) * up in `dtype` with torch's two roundings, from float32 `gate` and `up`
    that hold values of `dtype` (already rounded to it). One expression for every kernel
    that ends in this product (this module's kernel, the decode GEMV's slot sum of a fused
    gate_up projection: kernels/quant_matmul/slot_sum.py), so they give the same bits.
    Their launches pass enable_fp_fusion=False (see silu_mul_triton)."""
    if PRECISE_EXP:
        exp = libdevice.exp(-gate)
    else:
        exp = tl.exp(-gate)
    silu = cast_rtne(tl.math.div_rn(gate, 1.0 + exp), dtype, EMULATE_BF16)
    # A product of two 16-bit floats is exact in float32: rounding it equals torch's multiply.
    return cast_rtne(silu.to(tl.float32) * up, dtype, EMULATE_BF16)


@triton.jit
def _silu_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    gate_row_stride,
    up_row_stride,
    out_row_stride,
    n_cols,
    BLOCK: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels.backend)
):
    # Everything this kernel reads comes from earlier kernels: wait before any load.
    pdl_start(USE_PDL)
    # Grid: (rows, column blocks). int64 row offsets: rows * stride passes 2**31 in prefill.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    out = silu_mul_rounded(gate, up, dtype, PRECISE_EXP, EMULATE_BF16)
    tl.store(out_ptr + row * out_row_stride + cols, out, mask=mask)


# The interpreter has no libdevice and truncates float32 -> bfloat16 (kernels.backend).
_INTERPRETED = is_interpreted(_silu_mul_kernel)


def _rows(t: torch.Tensor) -> torch.Tensor:
    # [N, I]; a view where possible (rows may be strided), the last dim made dense.
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up through the Triton kernel; same contract as `silu_mul_reference`."""
    _check_args(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return out
    gate2d, up2d = _rows(gate), _rows(up)
    out2d = out.view(-1, gate.shape[-1])
    n_rows, n_cols = gate2d.shape
    pdl = programmatic_launch(gate)
    with device_guard(gate):
        _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, _BLOCK))](
            gate2d,
            up2d,
            out2d,
            gate2d.stride(0),
            up2d.stride(0),
            out2d.stride(0),
            n_cols,
            BLOCK=_BLOCK,
            PRECISE_EXP=not _INTERPRETED,
            EMULATE_BF16=_INTERPRETED,
            num_warps=4,
            # The float32 path has nothing to contract, but a fused multiply-add anywhere
            # would break the bit-for-bit match with torch's separately rounded ops.
            enable_fp_fusion=False,
            USE_PDL=pdl,
            launch_pdl=pdl,
        )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """F.silu(gate) * up for gate, up [..., I]; Triton on CUDA, the reference otherwise."""
    if resolve_backend(backend, gate, up) == "triton":
        return silu_mul_triton(gate, up)
    return silu_mul_reference(gate, up)
