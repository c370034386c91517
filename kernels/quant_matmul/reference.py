"""The quantized matmul's torch reference (the layout's meaning, in float32): what the
kernels are tested against and what runs off CUDA.

    dequantize_reference(qw) -> fp32 [k, n] in the original row order:
        W_orig[perm[i], :] = (code[i, :] - zeros[row_group[i], :]) * scales[row_group[i], :]
    quant_matmul_reference(x [..., k], qw) -> [..., n] in x.dtype: x @ W_orig + bias
"""

from __future__ import annotations

import torch

from kernels.quant_matmul.layout import QuantizedWeight


def dequantize_reference(qw: QuantizedWeight) -> torch.Tensor:
    """The dequantized weight, fp32 [k, n], in the original (unpermuted) row order."""
    k, n = qw.in_features, qw.out_features
    w_perm = torch.empty(k, n, dtype=torch.float32, device=qw.device)
    group = qw.row_group.long()
    for seg in qw.segments:
        g = group[seg.row_start : seg.row_end]
        codes = seg.codes().float()
        # code - zero is an exact small number and its product with an fp16 scale is exact in
        # fp32 (at most 9 + 11 significant bits): the true (q - z) * s of GPTQ and EXL2.
        w_perm[seg.row_start : seg.row_end] = (codes - qw.zeros[g].float()) * qw.scales[g].float()
    if qw.perm is None:
        return w_perm
    w = torch.empty_like(w_perm)
    w[qw.perm.long()] = w_perm
    return w


def quant_matmul_reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """y = x @ W_orig + bias for x [..., k]; computed in fp32, returned in x.dtype."""
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {qw.in_features}")
    y = x.float() @ dequantize_reference(qw)
    if qw.bias is not None:
        y = y + qw.bias.float()
    return y.to(x.dtype)
