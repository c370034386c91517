"""The decode GEMV opened to other kernels: they store float32 partials into one more slot of
its split-K workspace and count as more programs of its column tiles, so one kernel's
output lands in the GEMV's y with no extra pass. kernels/lora_matmul.py's expand is such a
kernel (LoRA's delta added on a quantized base at GEMV sizes, possibly on a second stream).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kernels.backend import device_guard
from kernels.quant_matmul.gemv import GemvTiling, gemv_slots, gemv_tiling, launch_gemv
from kernels.quant_matmul.layout import QuantizedWeight
from kernels.quant_matmul.paths import check_args, choose_path
from kernels.quant_matmul.split_k import split_k_workspace


@dataclasses.dataclass(frozen=True)
class GemvShare:
    """A decode GEMV that other kernels add into (kernels/lora_matmul.py's expand): they
    store their float32 terms into slot `extra_slot` of `sums` ([slots, M, n]; every
    row of their columns, zeros where they add nothing, since the slot is not zeroed
    between calls) and arrive at `counters[tile]` through `finish_gemv_tile` like one more
    split-K program, `extra` times per column tile. Whichever program arrives last sums the
    `slots` slots in order and writes the tile of y, so the order of the GEMV and the added
    kernels does not matter: they may run on two streams at once."""

    y: torch.Tensor  # [M, n] in x's dtype
    sums: torch.Tensor  # float32: the device's workspace, [slots, M, n] for this call
    counters: torch.Tensor  # int32 per column tile, zero between calls
    tiling: GemvTiling
    extra: int

    @property
    def arrivals(self) -> int:
        return self.tiling.arrivals + self.extra

    @property
    def slots(self) -> int:
        return gemv_slots(self.tiling, self.extra)

    @property
    def extra_slot(self) -> int:
        """The slot of the added kernels' terms: after the GEMV's split-K slots."""
        return self.tiling.arrivals


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
    extra = extra_per_tile(tiling.block_n)
    slots = gemv_slots(tiling, extra)
    workspace, counters = split_k_workspace(x2d.device, slots * M * n, tiling.n_tiles)
    y = torch.empty((M, n), dtype=x2d.dtype, device=x2d.device)
    return GemvShare(y, workspace, counters, tiling, extra)


def launch_gemv_shared(x2d: torch.Tensor, qw: QuantizedWeight, share: GemvShare) -> None:
    """The GEMV's own programs of a `gemv_share`; y is complete once the added programs
    have arrived too (stream order or an event join)."""
    with device_guard(x2d):
        launch_gemv(x2d, qw, share.y, share.tiling, share.extra)
