"""GPTQ tensors of one linear: validation, reference dequantizer, runtime conversion, writer.

On disk (k = in_features, n = out_features, b = bits in {4, 8}, G groups):

    qweight  int32 [k * b / 32, n]  codes along k, row j of a word at bits j*b (bitpack stream)
    qzeros   int32 [G, ceil(n * b / 32)]  zero points along n, same order within a word
    scales   fp16  [G, n]           (bf16/fp32 accepted and cast to fp16, as exllamav2 does)
    g_idx    int32 [k], optional    group of each input row; not monotone = act-order
    bias     fp16  [n], optional

    zero = stored + 1  for checkpoint_format "gptq" (v1: AutoGPTQ stores zero - 1; a stored
           2^b - 1 means zero 2^b, exactly as AutoGPTQ and exllamav2's `zeros + 1` read it)
    zero = stored      for "gptq_v2"
    W[i, c] = (code[i, c] - zero[g(i), c]) * scales[g(i), c]         W: [k, n], y = x @ W

Without g_idx the group size comes from the shapes as exllamav2's QMatrix does (the
smallest power of two with size * G >= k), falling back to k / G when that does not give
G groups. Symmetric GPTQ (AutoGPTQ) stores zero 2^(b-1), i.e. v1 nibbles 7 (0x77777777).

The runtime layout sorts rows by group (perm = stable argsort(g_idx)) so that groups are
contiguous, as exllamav2's make_sequential does, and keeps the zero points themselves
(exact in fp16), so the runtime weight (q - z) * s equals the reference exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.quant.bitpack import (
    make_segment,
    pack_along_columns,
    pack_bitstream,
    packed_rows,
    unpack_along_columns,
    unpack_bitstream,
)
from engine.quant.checks import QuantFormatError, check_tensor, fail
from kernels.quant_matmul.layout import Plane, QuantizedWeight, Segment, compact_zero_points

GPTQ_BITS = (4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def infer_group_size(k: int, num_groups: int) -> int:
    """Rows per group when g_idx is absent (see the module docstring)."""
    size = 1
    while size * num_groups < k:
        size *= 2
    if -(-k // size) == num_groups:
        return size
    if k % num_groups == 0:
        return k // num_groups
    raise ValueError(f"cannot split {k} rows into {num_groups} groups of one size")


@dataclass
class GptqTensors:
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    bits: int = 4
    checkpoint_format: str = "gptq"

    _TENSORS: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales", "g_idx", "bias")

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor],
        prefix: str = "",
        *,
        bits: int = 4,
        checkpoint_format: str = "gptq",
    ) -> GptqTensors:
        """From tensors named `<prefix>qweight` etc. (missing ones become None)."""
        # Missing ones are None here, for validate() to name.
        found: dict[str, Any] = {name: tensors.get(prefix + name) for name in cls._TENSORS}
        return cls(**found, bits=bits, checkpoint_format=checkpoint_format)

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in self._TENSORS if getattr(self, n) is not None}

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * 32 // self.bits

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def num_groups(self) -> int:
        return self.scales.shape[0]

    def group_index(self) -> torch.Tensor:
        """int64 [k]: the group of each input row (g_idx, or inferred from the shapes)."""
        if self.g_idx is not None:
            return self.g_idx.long()
        size = infer_group_size(self.in_features, self.num_groups)
        return torch.arange(self.in_features, device=self.qweight.device) // size

    def zero_points(self) -> torch.Tensor:
        """int32 [G, n]: the zero points, with the v1 offset undone."""
        stored = unpack_along_columns(self.qzeros, self.bits, self.out_features).to(torch.int32)
        return stored + 1 if self.checkpoint_format == "gptq" else stored

    def validate(self, name: str, in_features: int, out_features: int) -> None:
        """Raise QuantFormatError naming the tensor if this is not a valid GPTQ linear."""
        k, n, b = in_features, out_features, self.bits
        if b not in GPTQ_BITS:
            fail(name, "qweight", f"{b}-bit GPTQ is not supported (bits must be 4 or 8)")
        if self.checkpoint_format not in GPTQ_FORMATS:
            fail(name, "qzeros", f"unknown checkpoint_format {self.checkpoint_format!r}")
        per_word = 32 // b
        if k <= 0 or k % per_word:
            fail(name, "qweight", f"in_features {k} is not a positive multiple of {per_word}")
        check_tensor(name, "qweight", self.qweight, (torch.int32,), shape=(k // per_word, n))
        check_tensor(name, "scales", self.scales, _FLOATS, ndim=2)
        g = self.scales.shape[0]
        if g < 1 or self.scales.shape[1] != n:
            fail(name, "scales", f"shape must be [G >= 1, {n}], got {list(self.scales.shape)}")
        check_tensor(name, "qzeros", self.qzeros, (torch.int32,), shape=(g, packed_rows(n, b)))
        if self.g_idx is not None:
            check_tensor(name, "g_idx", self.g_idx, (torch.int32, torch.int64), shape=(k,))
            low, high = int(self.g_idx.min()), int(self.g_idx.max())
            if low < 0 or high >= g:
                fail(name, "g_idx", f"groups must lie in 0..{g - 1}, got {low}..{high}")
        else:
            try:
                infer_group_size(k, g)
            except ValueError as e:
                fail(name, "scales", f"{e} (no g_idx)")
        if self.bias is not None:
            check_tensor(name, "bias", self.bias, _FLOATS, shape=(n,))


def dequantize_gptq(t: GptqTensors) -> torch.Tensor:
    """The reference: fp32 [k, n] in the original row order."""
    codes = unpack_bitstream(t.qweight, t.bits, t.in_features).float()
    g = t.group_index()
    zeros = t.zero_points().float()[g]
    return (codes - zeros) * t.scales.to(torch.float16).float()[g]


def gptq_row_order(g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The runtime's row order for the groups `g` [k] of the input rows: (perm, the group of
    each runtime row). Rows sorted by group, stably; perm None where they already are."""
    if bool((g[1:] >= g[:-1]).all()):
        return None, g
    perm = torch.argsort(g, stable=True)
    return perm, g[perm]


def gptq_to_runtime(t: GptqTensors) -> QuantizedWeight:
    """Convert to the runtime layout: rows sorted by group, one Segment, compact zero
    points."""
    k, n = t.in_features, t.out_features
    g = t.group_index()
    scales = t.scales.to(torch.float16).contiguous()
    zeros = compact_zero_points(t.zero_points())  # 0..256: uint8, or int16 with a 256
    perm, row_group = gptq_row_order(g)
    if perm is None:
        # The qweight stream at 4 or 8 bits is already the plane layout.
        segment = Segment(t.bits, 0, k, [Plane(t.bits, 0, t.qweight.contiguous())])
    else:
        codes = unpack_bitstream(t.qweight, t.bits, k)[perm]
        segment = make_segment(codes, t.bits, 0)
        perm = perm.to(torch.int32)
    return QuantizedWeight(
        in_features=k,
        out_features=n,
        perm=perm,
        segments=[segment],
        scales=scales,
        zeros=zeros,
        row_group=row_group.to(torch.int32),
        bias=None if t.bias is None else t.bias.to(torch.float16).contiguous(),
    )


def pack_gptq(
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    *,
    g_idx: torch.Tensor | None = None,
    v2: bool = False,
    bias: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """GPTQ tensors from codes [k, n] (original row order), zero points [G, n], scales [G, n].

    Zero points are the real ones; v1 (v2=False) stores zero - 1, so it can hold 1..2^b
    and v2 0..2^b - 1.
    """
    if bits not in GPTQ_BITS:
        raise ValueError(f"GPTQ bits must be 4 or 8, got {bits}")
    stored = zeros.to(torch.int32) - (0 if v2 else 1)
    if int(stored.min()) < 0 or int(stored.max()) >= 1 << bits:
        span = f"0..{(1 << bits) - 1}" if v2 else f"1..{1 << bits}"
        raise ValueError(f"zero points must lie in {span} for {'v2' if v2 else 'v1'}")
    out = {
        "qweight": pack_bitstream(codes, bits),
        "qzeros": pack_along_columns(stored, bits),
        "scales": scales.to(torch.float16).contiguous(),
    }
    if g_idx is not None:
        out["g_idx"] = g_idx.to(torch.int32).contiguous()
    if bias is not None:
        out["bias"] = bias.to(torch.float16).contiguous()
    return out


def quantize_rtn_gptq(
    weight: torch.Tensor,
    bits: int,
    group_size: int = 128,
    *,
    sym: bool = True,
    act_order: bool = False,
    v2: bool = False,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Round-to-nearest GPTQ of an HF weight [n, k], with AutoGPTQ's min/max scale fit.

    group_size -1 means one group. act_order groups rows in the order `perm` (default:
    descending row norm, a stand-in for diag(H)) and writes the matching g_idx; g_idx is
    always written, as AutoGPTQ does. v1 cannot store a zero of 0, so v1 zeros are raised
    to at least 1.
    """
    w = weight.float().t().contiguous()  # [k, n]
    k, n = w.shape
    size = k if group_size == -1 else group_size
    if size <= 0:
        raise ValueError(f"group_size must be positive or -1, got {group_size}")
    num_groups = -(-k // size)
    if act_order:
        order = perm.long() if perm is not None else torch.argsort(w.norm(dim=1), descending=True)
    else:
        order = torch.arange(k, device=w.device)
    g_idx = torch.argsort(order) // size  # row order[j] sits at position j, in group j // size

    index = g_idx[:, None].expand(k, n)
    init = torch.zeros(num_groups, n, device=w.device)
    xmin = init.scatter_reduce(0, index, w, "amin", include_self=True)  # min(x.min, 0)
    xmax = init.scatter_reduce(0, index, w, "amax", include_self=True)  # max(x.max, 0)
    maxq = 2**bits - 1
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    dead = (xmin == 0) & (xmax == 0)
    xmin = torch.where(dead, torch.full_like(xmin, -1.0), xmin)
    xmax = torch.where(dead, torch.full_like(xmax, 1.0), xmax)
    scales = ((xmax - xmin) / maxq).to(torch.float16)
    if sym:
        zeros = torch.full_like(xmin, 2 ** (bits - 1))
    else:
        zeros = torch.round(-xmin / scales.float()).clamp(0 if v2 else 1, maxq)
    s = scales.float()[g_idx]
    codes = torch.clamp(torch.round(w / s) + zeros[g_idx], 0, maxq).to(torch.int32)
    return pack_gptq(codes, zeros.to(torch.int32), scales, bits, g_idx=g_idx, v2=v2, bias=bias)


__all__ = [
    "GPTQ_BITS",
    "GptqTensors",
    "QuantFormatError",
    "dequantize_gptq",
    "gptq_row_order",
    "gptq_to_runtime",
    "infer_group_size",
    "pack_gptq",
    "quantize_rtn_gptq",
]
