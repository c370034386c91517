"""Concatenating linears that read the same input, and switching fused small-op kernels.

`concat_linears(parts)` makes one linear whose output is the parts' outputs side by side
(along the output dimension): dense linears always; quantized linears (EXL2, GPTQ) when
one QuantizedWeight can describe all of them (same row permutation, row groups and
bit-width segments). The loader runs it on the parts of a linear that the build plan built
fused (engine/build_plan.py says when, engine/loading.py reads the parts), so the model
never holds the parts. A column of the fused product is computed exactly as the column of
its part.

`set_kernel_fusion(model, enabled)` switches the other kind of fusion, of small ops into one
kernel launch (residual add + RMSNorm, SiLU * up, RoPE + KV cache write; engine/modules.py),
in every `FusesKernels` module. The build plan sets it when the model is built; tools and
tests turn it off to compare with the separate ops.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.modules import FusesKernels, Linear
from engine.quantized_linear import QuantizedLinear
from kernels.quant_matmul.layout import Plane, QuantizedWeight, Segment, compact_zero_points


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))


def _segment_layout(qw: QuantizedWeight) -> list[tuple[int, int, int, list[tuple[int, int]]]]:
    return [
        (s.bits, s.row_start, s.row_end, [(p.bits, p.shift) for p in s.planes]) for s in qw.segments
    ]


def _fusable_quantized(parts: list[QuantizedLinear]) -> bool:
    first = parts[0].qweight
    for part in parts:
        qw = part.qweight
        if part.out_features != qw.out_features:  # padded columns would sit in between
            return False
        if qw.in_features != first.in_features or qw.scales.shape[0] != first.scales.shape[0]:
            return False
        if _segment_layout(qw) != _segment_layout(first):
            return False
        if not (_same(qw.perm, first.perm) and _same(qw.row_group, first.row_group)):
            return False
    return True


def _concat_quantized(parts: list[QuantizedLinear]) -> QuantizedLinear:
    weights = [p.qweight for p in parts]
    first = weights[0]
    segments = []
    for i, seg in enumerate(first.segments):
        planes = []
        for j, plane in enumerate(seg.planes):
            packed = torch.cat([w.segments[i].planes[j].packed for w in weights], 1)
            planes.append(Plane(plane.bits, plane.shift, packed))
        segments.append(Segment(seg.bits, seg.row_start, seg.row_end, planes))
    bias = None
    if any(w.bias is not None for w in weights):
        bias = torch.cat(
            [
                w.bias if w.bias is not None else first.scales.new_zeros(w.out_features)
                for w in weights
            ]
        )
    fused = QuantizedWeight(
        in_features=first.in_features,
        out_features=sum(w.out_features for w in weights),
        perm=first.perm,
        segments=segments,
        scales=torch.cat([w.scales for w in weights], 1),
        zeros=compact_zero_points(torch.cat([w.zeros.to(torch.float16) for w in weights], 1)),
        row_group=first.row_group,
        bias=bias,
    )
    fused.validate()
    return QuantizedLinear(fused, fused.out_features, parts[0].format)


def _concat_dense(parts: list[Linear]) -> Linear:
    weight = torch.cat([p.weight for p in parts], 0)
    has_bias = any(p.bias is not None for p in parts)
    fused = Linear.__new__(Linear)
    nn.Module.__init__(fused)
    fused.in_features = parts[0].in_features
    fused.out_features = weight.shape[0]
    fused.weight = nn.Parameter(weight, requires_grad=False)
    fused.bias = None
    if has_bias:
        biases = [p.bias if p.bias is not None else weight.new_zeros(p.out_features) for p in parts]
        fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    return fused


def concat_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One linear whose output is the parts' outputs side by side, or None if their formats
    do not allow it (different kinds, layouts, devices or dtypes)."""
    dense = [p for p in parts if type(p) is Linear]
    if len(dense) == len(parts):
        if len({(p.weight.dtype, p.weight.device, p.in_features) for p in dense}) != 1:
            return None
        return _concat_dense(dense)
    quantized = [p for p in parts if isinstance(p, QuantizedLinear)]
    if len(quantized) == len(parts):
        if len({(p.format, p.qweight.device) for p in quantized}) != 1:
            return None
        if not _fusable_quantized(quantized):
            return None
        return _concat_quantized(quantized)
    return None


def set_kernel_fusion(model: nn.Module, enabled: bool) -> int:
    """Turn the fused small-op kernels on or off in every module of `model` that has them
    (`FusesKernels`: CausalLM, Attention, the gated MLPs and MoE experts); returns how many
    modules were set. Results are the same either way; launches per layer differ."""
    count = 0
    for module in model.modules():
        if isinstance(module, FusesKernels):
            module.fuse_kernels = enabled
            count += 1
    return count
