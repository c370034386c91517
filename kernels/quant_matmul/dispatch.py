"""The quantized matmul's public functions: `quant_matmul` (Triton on CUDA tensors, the torch
reference otherwise), `quant_matmul_triton` (the kernels, on a path chosen by M or
forced: tests and benchmarks pick one), and `quant_matmul_silu_mul` (a gated MLP's fused
gate_up projection followed by kernels.silu_mul, one kernel fewer at decode).
"""

from __future__ import annotations

import torch

from kernels.activation import silu_mul_reference, silu_mul_triton
from kernels.backend import Backend, device_guard, resolve_backend
from kernels.quant_matmul.dequantize import dequant_matmul
from kernels.quant_matmul.dot import launch_dot
from kernels.quant_matmul.gemv import launch_gemv
from kernels.quant_matmul.layout import QuantizedWeight
from kernels.quant_matmul.paths import (
    GEMV_LIMIT_M,
    Path,
    check_args,
    choose_path,
    weight_tensors,
)
from kernels.quant_matmul.reference import quant_matmul_reference
from kernels.quant_matmul.split_k import unit_col_stride


def _check_out(out: torch.Tensor, x: torch.Tensor, n: int) -> None:
    """`out` of quant_matmul: [..., n] like the result, contiguous, in x's dtype or float32
    (the kernels sum in float32 and round once into it, whatever x's dtype)."""
    want = (*x.shape[:-1], n)
    if tuple(out.shape) != want:
        raise ValueError(f"out must have shape {want}, got {tuple(out.shape)}")
    if out.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"out must be {x.dtype} (x's dtype) or float32, got {out.dtype}")
    if out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor on {x.device}")


def quant_matmul_triton(
    x: torch.Tensor, qw: QuantizedWeight, *, path: Path = "auto", out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., k] @ W + bias through the Triton kernels; same contract as
    `quant_matmul_reference`. `path`: "gemv" (M <= GEMV_LIMIT_M), "dot", "dequant", or
    "auto" to choose by M (see the module docstring). `out`: where to write the result
    (see `quant_matmul`); returned.
    """
    check_args(x, qw)
    if out is not None:
        _check_out(out, x, qw.out_features)
    if path not in ("auto", "gemv", "dot", "dequant"):
        raise ValueError(f"path must be 'auto', 'gemv', 'dot' or 'dequant', got {path!r}")
    k, n = qw.in_features, qw.out_features
    lead = x.shape[:-1]
    x2d = unit_col_stride(x.reshape(-1, k))  # [M, k]
    M = x2d.shape[0]
    if path == "auto":
        path = choose_path(M)
    if M == 0 or n == 0:
        return out if out is not None else torch.empty((*lead, n), dtype=x.dtype, device=x.device)

    with device_guard(x):
        if path == "dequant":
            if out is None:
                return dequant_matmul(x2d, qw).reshape(*lead, n)
            # This path multiplies in x's dtype: a float32 out gets a float32 product.
            return out.copy_(dequant_matmul(x2d.to(out.dtype), qw).reshape(*lead, n))

        if path == "gemv" and M > GEMV_LIMIT_M:
            raise ValueError(f"path='gemv' takes at most {GEMV_LIMIT_M} rows of x, got {M}")
        if out is not None:
            y = out.view(M, n)
        else:
            y = torch.empty((M, n), dtype=x.dtype, device=x.device)
        if path == "gemv":
            launch_gemv(x2d, qw, y)
        else:
            launch_dot(x2d, qw, y)
    return out if out is not None else y.reshape(*lead, n)


def quant_matmul(
    x: torch.Tensor,
    qw: QuantizedWeight,
    *,
    backend: Backend = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., n] = x [..., k] @ W + bias in x's dtype; Triton on CUDA, the reference otherwise.

    `out` ([..., n], contiguous, x's dtype or float32) receives the result instead of a new
    tensor and is returned. A float32 `out` takes the kernels' float32 sums unrounded, so a
    consumer that wants them (tensor parallelism's all-reduce, which writes straight into
    its peer-readable buffer) needs no cast of x and no copy."""
    check_args(x, qw)
    if resolve_backend(backend, x, *weight_tensors(qw)) == "triton":
        return quant_matmul_triton(x, qw, out=out)
    if out is not None:
        _check_out(out, x, qw.out_features)
        return out.copy_(quant_matmul_reference(x.to(out.dtype), qw))
    return quant_matmul_reference(x, qw)


def quant_matmul_silu_mul(
    x: torch.Tensor, qw: QuantizedWeight, *, backend: Backend = "auto"
) -> torch.Tensor:
    """silu(gate) * up [..., n / 2] of a gated MLP's fused gate_up projection, whose output
    x @ W + bias is [gate | up] (n even): bit for bit `kernels.silu_mul` of the two halves
    of `quant_matmul(x, qw)`, on either backend. On the decode GEMV's path the slot sum
    computes the product from its float32 sums (kernels/quant_matmul/slot_sum.py): one
    launch and the [..., n] intermediate's write and read fewer. Other paths run the two
    ops."""
    check_args(x, qw)
    n = qw.out_features
    if n % 2:
        raise ValueError(f"a [gate | up] projection has an even out_features, got {n}")
    lead, half = x.shape[:-1], n // 2
    if resolve_backend(backend, x, *weight_tensors(qw)) != "triton":
        gate, up = quant_matmul_reference(x, qw).chunk(2, dim=-1)
        return silu_mul_reference(gate, up)
    x2d = unit_col_stride(x.reshape(-1, qw.in_features))
    M = x2d.shape[0]
    if M == 0 or n == 0 or choose_path(M) != "gemv":
        gate, up = quant_matmul_triton(x, qw).chunk(2, dim=-1)
        return silu_mul_triton(gate, up)
    y = torch.empty((M, half), dtype=x.dtype, device=x.device)
    with device_guard(x):
        launch_gemv(x2d, qw, y, silu_mul=True)
    return y.reshape(*lead, half)
