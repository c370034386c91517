"""Kernel tests' shared pieces for running Triton kernels on CPU tensors (the interpreter)
as well as on a GPU, and their seeded inputs."""

from __future__ import annotations

import os

import pytest
import torch


def require_triton(device: str) -> None:
    """Skip a Triton test on CPU tensors unless the interpreter is on (TRITON_INTERPRET=1,
    as CI sets it; unset on GPU machines)."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (unset on GPU machines)")


def seeded_randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int, scale: float = 1.0
) -> torch.Tensor:
    """Normal values times `scale`, drawn on the CPU from `seed` (the same on every device),
    in `dtype` on `device`."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)
