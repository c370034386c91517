"""A fused qkv projection of an input that is already normalized, with RoPE and the native
cache write in its slot sum (kernels/quant_matmul/slot_sum_rope.py): the decode GEMV stores
its split-K partials and one kernel sums them, adds the bias, rotates q and k, returns q and
writes k and v. The bits of quant_matmul followed by kernels.apply_rope_write, one launch
and the [T, (Hq + 2 Hk) D] qkv tensor fewer.

Where the input norm folds into the GEMV (norm_fold.quant_matmul_normed_rope) the slot sum
also applies its rstd; this is the same step where the norm ran elsewhere first: a
tensor-parallel rank's input norm runs inside its all-reduce kernel
(engine/tensor_parallel/site_reduce.py), and a step's first layer reads a norm kernel's
output. Issue 33: one launch per layer fewer on every rank.
"""

from __future__ import annotations

import torch

from kernels.backend import device_guard
from kernels.quant_matmul.gemv import launch_gemv_to_slots
from kernels.quant_matmul.layout import QuantizedWeight
from kernels.quant_matmul.paths import GEMV_MAX_M, check_args
from kernels.quant_matmul.slot_sum_rope import RopeCacheWrite, launch_slot_sum_rope
from kernels.quant_matmul.split_k import unit_col_stride


def qkv_rope_applies(x: torch.Tensor, qw: QuantizedWeight, rope_width: int) -> bool:
    """Whether `quant_matmul_rope` takes x [T, k] @ W: the decode GEMV's rows (at most
    GEMV_MAX_M), float16/bfloat16 x, and W's out_features the heads' width (no padding)."""
    return (
        x.dim() == 2
        and x.dtype in (torch.float16, torch.bfloat16)
        and 0 < x.shape[0] <= GEMV_MAX_M
        and qw.out_features == rope_width
    )


def quant_matmul_rope(x: torch.Tensor, qw: QuantizedWeight, rope: RopeCacheWrite) -> torch.Tensor:
    """The rotated q [T, Hq, D] of x [T, k] @ W (+ bias), k and v rotated/stored at rope.slots
    of rope's caches (x's dtype). `qkv_rope_applies(x, qw, rope.width)` must hold."""
    check_args(x, qw)
    if not qkv_rope_applies(x, qw, rope.width):
        raise ValueError(
            f"quant_matmul_rope takes float16/bfloat16 x of 1..{GEMV_MAX_M} rows and a qkv "
            f"projection of {rope.width} outputs ({rope.num_heads} + 2 x {rope.num_kv_heads} "
            f"heads of {rope.head_dim}); got x {x.dtype} {tuple(x.shape)}, "
            f"out_features {qw.out_features}"
        )
    x2d = unit_col_stride(x)
    q = torch.empty((x2d.shape[0], rope.num_heads, rope.head_dim), dtype=x.dtype, device=x.device)
    with device_guard(x):
        # The bias in split 0's partial, as the unfused GEMV adds it (not after the sum, as
        # the folded norm must): the same float32 additions, so the same bits.
        sums, slots = launch_gemv_to_slots(x2d, qw)
        launch_slot_sum_rope(sums, slots, rope, q)
    return q
