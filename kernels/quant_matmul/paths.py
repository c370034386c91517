"""Which path a quantized matmul takes (by M, the rows of x: see kernels/quant_matmul's
docstring) and what it accepts: the thresholds, `choose_path`, `check_args`.
"""

from __future__ import annotations

from typing import Literal

import torch

from kernels.quant_matmul.layout import QuantizedWeight, per_group_zeros

Path = Literal["auto", "gemv", "dot", "dequant"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Path thresholds on M, the number of activation rows (measured with tools/tune_gemv.py and
# tools/tune_mid_m.py, 8B shapes; see the package's docstring).
GEMV_MAX_M = 2
GEMV_LIMIT_M = 4  # the GEMV unrolls one accumulator per row of x: its hard limit
DEQUANT_MIN_M = 256


def choose_path(M: int) -> Path:
    if M <= GEMV_MAX_M:
        return "gemv"
    if M < DEQUANT_MIN_M:
        return "dot"
    return "dequant"


def weight_tensors(qw: QuantizedWeight) -> list[torch.Tensor]:
    tensors = [qw.scales, qw.zeros, qw.row_group]
    tensors += [t for t in (qw.perm, qw.bias) if t is not None]
    tensors += [plane.packed for segment in qw.segments for plane in segment.planes]
    return tensors


def check_args(x: torch.Tensor, qw: QuantizedWeight) -> None:
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (its last one is k)")
    if x.shape[-1] != qw.in_features:
        raise ValueError(
            f"x's last dimension ({x.shape[-1]}) must equal the weight's in_features "
            f"k={qw.in_features} (out_features n={qw.out_features})"
        )
    weight_devices = {t.device for t in weight_tensors(qw)}
    if len(weight_devices) > 1:
        names = ", ".join(sorted(str(d) for d in weight_devices))
        raise ValueError(f"the quantized weight's tensors are on several devices: {names}")
    if weight_devices and x.device not in weight_devices:
        raise ValueError(
            f"x is on {x.device} but the quantized weight is on {next(iter(weight_devices))}"
        )
    # The kernels index these with one stride (scales and zeros share theirs, unless zeros
    # hold one zero point per group); a weight that passed QuantizedWeight.validate()
    # always qualifies.
    named = {"scales": qw.scales, "zeros": qw.zeros, "row_group": qw.row_group}
    named.update({"perm": qw.perm, "bias": qw.bias})
    for name, t in named.items():
        if t is not None and not t.is_contiguous() and not (t is qw.zeros and per_group_zeros(t)):
            raise ValueError(
                f"the quantized weight's {name} must be contiguous"
                + (" or one zero point per group (strides (1, 0))" if name == "zeros" else "")
            )
