"""RMSNorm folded into a decoder layer's decode GEMVs (issue 28): o_proj's and down_proj's
slot sums add the residual and write the next norm's partial sums of squares and h * w (w
the next norm's weight); the qkv and gate_up GEMVs read h * w as x and their slot sums
scale each output by the row's rstd, then add the bias (kernels/quant_matmul/
norm_fold.py: rms_norm(h) @ W = rstd * ((h * w) @ W)). Per layer two add_rms_norm launches
fewer, no norm work in the GEMVs; the same bits every run, not the unfused ops' bits (h * w
is kept in float32, exact, where rms_norm rounds h * rstd * w to h's dtype).

Only the plain case folds (DecoderLayer._folded, `linears_fold`): quantized linears on the
decode GEMV (CUDA, at most GEMV_MAX_M rows), no LoRA batch (a linear wrapped for loaded
adapters still folds when no row of the batch uses one: the wrapper then runs its base alone,
and the base model's bits must not depend on what else is loaded), no forward hooks, unpadded
weights, stock attention with one qkv_proj and a gated MLP with one gate_up_proj, norms
without a dtype promotion. Tensor parallelism's row-parallel linears are not QuantizedLinear
(its site kernel does the add and norm itself), so its layers do not fold; their qkv
projections (column shards, plain QuantizedLinear) still rotate q and k and write the cache
in their slot sum (`projection_rotates`), as the first layer of a step does. Everything else
runs the unfused kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from engine.lora.layers import LoraLinear
from engine.quantized_linear import QuantizedLinear
from kernels.quant_matmul.layout import QuantizedWeight
from kernels.quant_matmul.norm_fold import norm_fold_applies
from kernels.quant_matmul.qkv_rope import qkv_rope_applies
from kernels.quant_matmul.slot_sum import RowSquares
from kernels.quant_matmul.split_k import row_order

# Process-wide switches (benchmarks and tests compare both ways).
_ENABLED = True
_ROW_ORDER = True


def set_norm_fold(enabled: bool) -> None:
    """Fold norms into the GEMVs (the default) or run them as kernels, for forwards from
    now on (CUDA graphs keep what they captured)."""
    global _ENABLED
    _ENABLED = bool(enabled)


def set_input_row_order(enabled: bool) -> None:
    """Let the fold's slot sums store the inputs of qkv, gate_up and down_proj in those
    weights' row order (`input_row_order`, the default) or not, for forwards from now on."""
    global _ROW_ORDER
    _ROW_ORDER = bool(enabled)


def input_row_order(weight: QuantizedWeight) -> torch.Tensor | None:
    """Where the slot sum before `weight`'s GEMV stores each column of that GEMV's input:
    weight's row order (kernels.quant_matmul.split_k.row_order, the inverse of its
    act-order perm), so that the GEMV reads x without a gather and adds the same products
    in the same order, the same bits. None (a plain store, the GEMV gathers) when weight
    has no perm or the switch is off. On one H200 the gather cost an 8B EXL2 model's
    qkv 1.3 us, gate_up 3.4 us and down_proj 2.4 us a layer (bench/results/
    2026-11-29-h200-exl2-row-order-s22.json)."""
    return row_order(weight) if _ROW_ORDER else None


@dataclass
class FoldedHidden:
    """A decoder layer's output with the next norm pending in the next GEMV: h [T, D] the
    hidden state (residual added), squares its RowSquares; xw = h * w for `norm` (w its
    weight, 1 + w with a unit offset), the next layer's input norm, or both None (the
    next norm then runs as a kernel on h). xw_perm: the act-order perm of the GEMV that
    xw was stored for in row order (`input_row_order`: xw is (h * w)[:, xw_perm]), or
    None (xw in h's order); only that GEMV may read it then."""

    h: torch.Tensor
    squares: RowSquares
    xw: torch.Tensor | None = None
    norm: nn.Module | None = None
    xw_perm: torch.Tensor | None = None

    def xw_for(self, weight: QuantizedWeight) -> tuple[torch.Tensor, bool] | None:
        """(xw, whether it is in weight's row order) for the GEMV of `weight`, or None when
        there is no xw or it was stored in another weight's row order."""
        if self.xw is None or (self.xw_perm is not None and self.xw_perm is not weight.perm):
            return None
        return self.xw, self.xw_perm is not None


def folded_weight(linear: nn.Module | None) -> QuantizedWeight:
    """The quantized weight of a linear that `linears_fold` accepted."""
    base = plain_quantized(linear)
    if base is None:
        raise TypeError(f"not a plain QuantizedLinear: {type(linear).__name__}")
    return base.qweight


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def plain_quantized(linear: nn.Module | None) -> QuantizedLinear | None:
    """The linear if it is a bare QuantizedLinear (no hooks, n unpadded), or the base of a
    LoraLinear wrapping one: callers fold only batches without LoRA, where the wrapper's
    forward is its base's (engine/lora/layers.py)."""
    if type(linear) is LoraLinear and not _hooked(linear):
        linear = linear.base
    if type(linear) is not QuantizedLinear:
        return None
    if _hooked(linear):
        return None
    if linear.qweight.out_features != linear.out_features:
        return None
    return linear


def norm_folds(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether an RMSNorm's (engine.modules) output dtype is x's (the GEMV reads it in x's
    dtype): its weight in x's dtype, on x's device."""
    weight = norm.weight
    return (
        isinstance(weight, torch.Tensor) and weight.dtype == x.dtype and weight.device == x.device
    )


def kernels_run_on(x: torch.Tensor) -> bool:
    """Whether the fold's Triton kernels run on x's device: CUDA. (The interpreter runs them
    on CPU tensors too, which tests/engine/test_norm_fold_engine.py uses to check the
    engine's fold path where no GPU is; on the CPU the engine's own path is torch's.)"""
    return x.is_cuda


def projection_rotates(
    x: torch.Tensor, qkv: nn.Module | None, width: int
) -> QuantizedWeight | None:
    """The weight of a fused qkv projection whose slot sum can rotate q and k and write the
    cache for input x without a folded norm (kernels/quant_matmul/qkv_rope.py): a plain
    quantized linear of `width` outputs at the decode GEMV's rows, where the fold's kernels
    run and the fold is on (set_norm_fold switches the decode GEMV's fusions together).
    None otherwise."""
    if not (_ENABLED and kernels_run_on(x)):
        return None
    base = plain_quantized(qkv)
    if base is None or not qkv_rope_applies(x, base.qweight, width):
        return None
    return base.qweight


def linears_fold(
    x: torch.Tensor,
    normed: tuple[nn.Module | None, ...],
    residual: tuple[nn.Module | None, ...],
) -> bool:
    """Whether each linear is a plain quantized one that folds a norm at x's rows: `normed`
    apply a norm to their input (qkv, gate_up), `residual` end in the next norm's residual
    add and squares (o_proj, down_proj)."""
    if not (_ENABLED and kernels_run_on(x)):
        return False
    sides: tuple[tuple[tuple[nn.Module | None, ...], Literal["in", "out"]], ...] = (
        (normed, "in"),
        (residual, "out"),
    )
    for linears, side in sides:
        for linear in linears:
            base = plain_quantized(linear)
            if base is None or not norm_fold_applies(x, base.qweight, side):
                return False
    return True
