"""The quantized matmul's public functions: `quant_matmul` (Triton on CUDA tensors, the torch
reference otherwise) and `quant_matmul_triton` (the kernels, on a path chosen by M or
forced: tests and benchmarks pick one).
"""

from __future__ import annotations

import torch

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


def quant_matmul_triton(
    x: torch.Tensor, qw: QuantizedWeight, *, path: Path = "auto"
) -> torch.Tensor:
    """x [..., k] @ W + bias through the Triton kernels; same contract as
    `quant_matmul_reference`. `path`: "gemv" (M <= GEMV_LIMIT_M), "dot", "dequant", or
    "auto" to choose by M (see the module docstring).
    """
    check_args(x, qw)
    if path not in ("auto", "gemv", "dot", "dequant"):
        raise ValueError(f"path must be 'auto', 'gemv', 'dot' or 'dequant', got {path!r}")
    k, n = qw.in_features, qw.out_features
    lead = x.shape[:-1]
    x2d = unit_col_stride(x.reshape(-1, k))  # [M, k]
    M = x2d.shape[0]
    if path == "auto":
        path = choose_path(M)
    if M == 0 or n == 0:
        return torch.empty((*lead, n), dtype=x.dtype, device=x.device)

    with device_guard(x):
        if path == "dequant":
            return dequant_matmul(x2d, qw).reshape(*lead, n)

        if path == "gemv" and M > GEMV_LIMIT_M:
            raise ValueError(f"path='gemv' takes at most {GEMV_LIMIT_M} rows of x, got {M}")
        if path == "gemv":
            y = torch.empty((M, n), dtype=x.dtype, device=x.device)
            launch_gemv(x2d, qw, y)
            return y.reshape(*lead, n)
        y = torch.empty((M, n), dtype=x.dtype, device=x.device)
        launch_dot(x2d, qw, y)
    return y.reshape(*lead, n)


def quant_matmul(
    x: torch.Tensor, qw: QuantizedWeight, *, backend: Backend = "auto"
) -> torch.Tensor:
    """y [..., n] = x [..., k] @ W + bias in x's dtype; Triton on CUDA, the reference otherwise."""
    check_args(x, qw)
    if resolve_backend(backend, x, *weight_tensors(qw)) == "triton":
        return quant_matmul_triton(x, qw)
    return quant_matmul_reference(x, qw)
