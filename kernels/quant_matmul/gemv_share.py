"""The decode GEMV opened to other kernels: they add float32 partials into its split-K sums
and count as more programs of its column tiles, so one kernel's output lands in the GEMV's
y with no extra pass. kernels/lora_matmul.py's expand is such a kernel (LoRA's delta added
on a quantized base at GEMV sizes, possibly on a second stream).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kernels.backend import device_guard
from kernels.quant_matmul.gemv import GemvTiling, gemv_tiling, launch_gemv
from kernels.quant_matmul.layout import QuantizedWeight
from kernels.quant_matmul.paths import check_args, choose_path
from kernels.quant_matmul.split_k import (
    check_fixed_point_arrivals,
    split_k_workspace,
    sums_view,
)


@dataclasses.dataclass(frozen=True)
class GemvShare:
    """A decode GEMV that other kernels add into (kernels/lora_matmul.py's expand): they
    atomically add float32 terms to `sums` (row stride n) and arrive at `counters[tile]`
    through `finish_gemv_tile` like one more split-K program, `extra` times per column tile.
    Whichever program arrives last writes the tile of y, so the order of the GEMV and the
    added kernels does not matter: they may run on two streams at once."""

    y: torch.Tensor  # [M, n] in x's dtype
    sums: torch.Tensor  # the device's workspace (int64 fixed point for float16 y), zero
    # between calls
    counters: torch.Tensor  # int32 per column tile, zero between calls
    tiling: GemvTiling
    extra: int

    @property
    def arrivals(self) -> int:
        return self.tiling.arrivals + self.extra


def gemv_share(
    x2d: torch.Tensor, qw: QuantizedWeight, extra_per_tile: Callable[[int], int]
) -> GemvShare | None:
    """Open the decode GEMV of x2d [M, k] @ W to `extra_per_tile(block_n)` added programs per
    column tile, or None when x2d would take another path (M > GEMV_MAX_M, empty shapes).
    Launch
    it with `launch_gemv_shared`; the added kernels need `tiling.block_n`, `tiling.n_tiles`
    and `arrivals`. The workspace must not be used by another GEMV until both are done."""
    check_args(x2d, qw)
    M, n = x2d.shape[0], qw.out_features
    if x2d.dim() != 2 or x2d.stride(1) != 1 or M == 0 or n == 0 or choose_path(M) != "gemv":
        return None
    tiling = gemv_tiling(x2d, qw)
    workspace, counters = split_k_workspace(x2d.device, M * n, tiling.n_tiles)
    y = torch.empty((M, n), dtype=x2d.dtype, device=x2d.device)
    share = GemvShare(
        y, sums_view(workspace, y.dtype), counters, tiling, extra_per_tile(tiling.block_n)
    )
    check_fixed_point_arrivals(share.arrivals)
    return share


def launch_gemv_shared(x2d: torch.Tensor, qw: QuantizedWeight, share: GemvShare) -> None:
    """The GEMV's own programs of a `gemv_share`; y is complete once the added programs
    have arrived too (stream order or an event join)."""
    with device_guard(x2d):
        launch_gemv(x2d, qw, share.y, share.tiling, share.extra)
