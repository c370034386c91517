"""Compute kernels: each op is a Triton kernel, a pure-torch reference and a dispatcher.

`kernels.<op>(..., backend="auto")` runs Triton on CUDA tensors and the reference otherwise
(see kernels.backend). The reference and Triton functions live in the op's module, e.g.
`from kernels.rms_norm import rms_norm_reference` (the package attribute `kernels.rms_norm`
is the op itself, which shadows the module of the same name).
"""

from kernels.activation import silu_mul
from kernels.attention import paged_attention
from kernels.backend import Backend
from kernels.quant_matmul import quant_matmul
from kernels.rms_norm import add_rms_norm, rms_norm
from kernels.rope import apply_rope, apply_rope_write

__all__ = [
    "Backend",
    "add_rms_norm",
    "apply_rope",
    "apply_rope_write",
    "paged_attention",
    "quant_matmul",
    "rms_norm",
    "silu_mul",
]
