"""The decode GEMV opened to other kernels: they store float32 terms into one more slot of
its split-K workspace, and the slot sum that writes y adds that slot after the GEMV's own,
so one kernel's output lands in the GEMV's y with one rounding and no extra pass.
kernels/lora_matmul.py's expand is such a kernel (LoRA's delta added on a quantized base at
GEMV sizes, possibly on a second stream).
"""

from __future__ import annotations

import dataclasses

import torch

from kernels.backend import device_guard
from kernels.quant_matmul.gemv import GemvTiling, gemv_slots, gemv_tiling, launch_gemv_partials
from kernels.quant_matmul.layout import QuantizedWeight
from kernels.quant_matmul.paths import check_args, choose_path
from kernels.quant_matmul.slot_sum import launch_slot_sum
from kernels.quant_matmul.split_k import split_k_workspace


@dataclasses.dataclass(frozen=True)
class GemvShare:
    """A decode GEMV that another kernel adds into (kernels/lora_matmul.py's expand): that
    kernel stores its float32 terms into slot `extra_slot` of `sums` ([slots, rows, n]:
    every row of every column below n, zeros where it adds nothing, since the slot is not
    zeroed between calls). The GEMV's programs (`launch_gemv_shared`) and the added kernel
    may run in either order, on two streams at once; `finish_gemv_shared`, once both are
    done, sums the slots in order into y: [rows, n], or with `silu_mul` (a gated MLP's
    [gate | up] projection) [rows, n / 2] = silu(gate) * up (kernels/quant_matmul/
    slot_sum.py)."""

    y: torch.Tensor  # [M, n] (or [M, n / 2] with silu_mul) in x's dtype
    sums: torch.Tensor  # float32: the device's workspace, [slots, M, n] for this call
    tiling: GemvTiling
    n: int  # the GEMV's output columns (the slots' row width)
    silu_mul: bool = False

    @property
    def rows(self) -> int:
        return self.y.shape[0]

    @property
    def slots(self) -> int:
        return gemv_slots(self.tiling, 1)

    @property
    def extra_slot(self) -> int:
        """The slot of the added kernel's terms: after the GEMV's split-K slots."""
        return self.tiling.arrivals


def gemv_share(
    x2d: torch.Tensor, qw: QuantizedWeight, *, silu_mul: bool = False
) -> GemvShare | None:
    """Open the decode GEMV of x2d [M, k] @ W to one added kernel's terms, or None when x2d
    would take another path (M > GEMV_MAX_M, empty shapes; with `silu_mul`, an odd n).
    Launch the GEMV with `launch_gemv_shared` and the added kernel in either order, then
    `finish_gemv_shared`. The workspace must not be used by another GEMV until the finish
    is done."""
    check_args(x2d, qw)
    M, n = x2d.shape[0], qw.out_features
    if x2d.dim() != 2 or x2d.stride(1) != 1 or M == 0 or n == 0 or choose_path(M) != "gemv":
        return None
    if silu_mul and n % 2:
        return None
    tiling = gemv_tiling(x2d, qw)
    workspace, _ = split_k_workspace(x2d.device, gemv_slots(tiling, 1) * M * n, 0)
    y = torch.empty((M, n // 2 if silu_mul else n), dtype=x2d.dtype, device=x2d.device)
    return GemvShare(y, workspace, tiling, n, silu_mul)


def launch_gemv_shared(x2d: torch.Tensor, qw: QuantizedWeight, share: GemvShare) -> None:
    """The GEMV's own programs of a `gemv_share`: its partial slots, not y yet."""
    with device_guard(x2d):
        launch_gemv_partials(x2d, qw, share.sums, share.tiling)


def finish_gemv_shared(share: GemvShare) -> None:
    """y of a `gemv_share`, once the GEMV and the added kernel are both done (stream order
    or an event join): their slots summed in order (and silu(gate) * up taken with
    `silu_mul`). Launched without programmatic dependent launch, which would wait only for
    the kernel before it in this stream, not for the other branch of a join."""
    with device_guard(share.y):
        launch_slot_sum(share.sums, share.y, share.slots, silu_mul=share.silu_mul, pdl=False)
