"""Compute kernels: each op is a Triton kernel, a pure-torch reference and a dispatcher.

`kernels.<op>(..., backend="auto")` runs Triton on CUDA tensors and the reference otherwise
(see kernels.backend). The reference and Triton functions live in the op's module, e.g.
`from kernels.rms_norm import rms_norm_reference`; an op of several kernels is a package
(kernels/quant_matmul/, kernels/attention/) whose __init__ exports its entry points. The
package attribute `kernels.rms_norm` (and `kernels.quant_matmul`) is the op itself, which
shadows the module or package of the same name: import from it with `from kernels.quant_matmul
import gemv` or importlib, not `import kernels.quant_matmul.gemv as gemv`.
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
