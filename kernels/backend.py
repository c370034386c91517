"""Backend selection shared by every kernel op.

Contract: each op `kernels.<op>(..., backend="auto")` runs its Triton kernel on CUDA tensors
and its pure-torch reference otherwise. Tests force a path with `backend="triton"` or
`backend="torch"`. Forcing Triton on CPU tensors only works under the Triton interpreter
(`TRITON_INTERPRET=1`, which must be set before the kernel modules are imported).

The environment variable is read only when Triton is forced onto CPU tensors, never on the
"auto" path, so the hot path stays free of global settings.

`cast_rtne` is the float32 -> float16/bfloat16 cast for kernels whose results must match
torch's rounding under the interpreter too (see its docstring).

Programmatic dependent launch (PDL, Hopper and later): the decode path's kernels are
launched with `launch_pdl` where `programmatic_launch(tensor)` says so. Such a kernel may
start while the kernel before it in the stream is still running; it first lets its own
successor launch (`pdl_launch_dependents`), may read what no kernel writes (weights) and
must `pdl_wait` (every program, before any other load or store) until the previous
kernel is complete and its writes are visible. Since every program waits, a kernel never
completes before its predecessor, so the chain stays ordered. What it buys: the launch
latency and the first weight loads of each kernel overlap the tail of the one before,
about a microsecond or two per kernel in a decode step of a few hundred kernels.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Literal

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

Backend = Literal["auto", "triton", "torch"]
ResolvedBackend = Literal["triton", "torch"]

_BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: Backend, *tensors: torch.Tensor) -> ResolvedBackend:
    """The path an op takes for `tensors`: "triton" or "torch".

    Raises ValueError for an unknown backend or tensors on different devices, and
    RuntimeError when Triton is forced onto CPU tensors outside the Triton interpreter.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"tensors must be on one device, got {names}")
    device = next(iter(devices)) if devices else torch.device("cpu")

    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    if device.type == "cpu":
        raise RuntimeError(
            "backend='triton' on CPU tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before importing kernels (tests/conftest.py does so "
            "when there is no GPU)"
        )
    raise RuntimeError(f"backend='triton' needs CUDA tensors, got tensors on {device}")


def device_guard(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make `tensor`'s GPU the current one for a launch.

    Triton launches on the current CUDA device; with layers split across GPUs the caller's
    current device may be another one, and the launch would touch foreign memory.
    """
    if tensor.device.type != "cuda" or tensor.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(tensor.device)


def is_interpreted(kernel: object) -> bool:
    """Whether a `@triton.jit` kernel runs in the Triton interpreter (decided at decoration).

    Kernels pass this as `cast_rtne`'s `EMULATE_BF16`; modules compute it once at import.
    """
    return isinstance(kernel, InterpretedFunction)


@triton.jit
def cast_rtne(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """float32 `x` cast to `dtype`, rounding to nearest even as torch does.

    GPUs round natively. Triton 3.6's interpreter truncates float32 -> bfloat16 instead, so
    there (EMULATE_BF16) the rounding is done on the bits: add 0x7FFF plus the lowest kept
    bit, then drop the low 16 bits; the truncating cast of the result is then exact.
    """
    if EMULATE_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(dtype)


# Whether kernels that support it are launched with programmatic dependent launch (see the
# module docstring). A process-wide switch so that benchmarks can compare both ways.
_PROGRAMMATIC_LAUNCH = True


def set_programmatic_launch(enabled: bool) -> None:
    """Turn programmatic dependent launch on or off for kernels launched from now on (CUDA
    graphs keep the launches they captured)."""
    global _PROGRAMMATIC_LAUNCH
    _PROGRAMMATIC_LAUNCH = bool(enabled)


@functools.cache
def _supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def programmatic_launch(tensor: torch.Tensor) -> bool:
    """Whether a kernel working on `tensor` is launched with PDL: on for CUDA devices of
    compute capability 9.0 and later, unless `set_programmatic_launch(False)`."""
    if not _PROGRAMMATIC_LAUNCH or tensor.device.type != "cuda":
        return False
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    return _supports_pdl(index)


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel in the stream launch once every program of this one got here."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel in the stream is complete and its writes visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """The opening of a kernel whose first loads read an earlier kernel's output: let the
    next kernel launch, then wait for the previous one (a kernel that can load weights
    first calls the two apart, see kernels/quant_matmul/gemv.py)."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
