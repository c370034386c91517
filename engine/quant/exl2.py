"""EXL2 tensors of one linear: validation, the reference dequantizer, the runtime conversion.

On disk (k = in_features, n = out_features, w >= n the stored width, G groups):

    q_weight     int32 [sum_g packed_rows(rows_g, bits_g), w]  codes, bit stream per group
    q_scale      int32 [G, w / 8]   4-bit scale code s per (group, column), column c at 4*(c%8)
    q_scale_max  fp16  [G]          per-group maximum scale
    q_groups     int16 [2G]         (bits_g, first q_weight row of group g) pairs
    q_invperm    int32 [k]          inverse of the act-order permutation
    q_perm       int   [k], optional; ignored (exllamav2 recomputes argsort(q_invperm))
    bias         fp16  [n or w], optional

Stored row r (groups in order, rows_g = packed rows * 32 / bits_g, the last group takes what
remains of k) holds original input row q_perm[r], q_perm = argsort(q_invperm):

    scale[g, c] = fp16(fp16((s + 1)^2) * fp16(q_scale_max[g] / 256))
    W[q_perm[r], c] = (code[r, c] - 2^(bits_g - 1)) * scale[g, c]      W: [k, n], y = x @ W

The scale is rounded exactly as exllamav2 computes it (ext.py make_q_matrix premultiplies
q_scale_max by 1/256 in fp16, qdq_util.cuh dq_scale multiplies by (s+1)^2 in fp16); below
q_scale_max = 2^-6 the premultiplied value is an fp16 subnormal and loses bits, which the
converter's own codes already account for, so it is reproduced rather than idealized.

The writer pads w to a multiple of 32 (padded codes are the zero point, padded scale codes
15). Groups are ordered by non-increasing bits; every group but the last is a multiple of
32 rows (16 at 2 bits), as exllamav2's kernels require; k <= 65536 because exllamav2
narrows q_perm/q_invperm to 16 bits (`.short()` in ext.py, read as uint16_t in the kernels).
The last group packs into ceil(rows * bits / 32) words. exllamav2 derives that group's rows
as words * 32 // bits (make_group_map), so it reads a file only when the last group fills
whole words, and its kernels step 32 rows at a time: k % 32 == 0 keeps a file loadable
there. Kestrel reads any k.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from engine.quant.bitpack import make_segment, packed_rows, unpack_along_columns, unpack_bitstream
from engine.quant.checks import check_permutation, check_tensor, fail
from kernels.quant_matmul.layout import Plane, QuantizedWeight, Segment, compact_zero_points

EXL2_BITS = (2, 3, 4, 5, 6, 8)
#: Permutation indices are uint16 in exllamav2, so k - 1 <= 65535.
EXL2_MAX_IN_FEATURES = 65536
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def exl2_group_rows_multiple(bits: int) -> int:
    """Rows every group but the last must be a multiple of (exllamav2 kernels' step)."""
    return 16 if bits == 2 else 32


@dataclass(frozen=True)
class Exl2Group:
    bits: int
    row_start: int  # rows of the stored (permuted) order
    row_end: int
    qrow_start: int  # rows of q_weight
    qrow_end: int


@dataclass
class Exl2Tensors:
    q_weight: torch.Tensor
    q_scale: torch.Tensor
    q_scale_max: torch.Tensor
    q_groups: torch.Tensor
    q_invperm: torch.Tensor
    q_perm: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @classmethod
    def from_dict(cls, tensors: Mapping[str, torch.Tensor], prefix: str = "") -> Exl2Tensors:
        """From tensors named `<prefix>q_weight` etc. (missing ones become None)."""
        found: dict[str, Any] = {f.name: tensors.get(prefix + f.name) for f in fields(cls)}
        return cls(**found)  # missing ones are None here, for validate() to name

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    @property
    def in_features(self) -> int:
        return self.q_invperm.shape[0]

    @property
    def width(self) -> int:
        """Stored columns (out_features, or out_features padded to a multiple of 32)."""
        return self.q_weight.shape[1]

    def groups(self, name: str = "exl2") -> list[Exl2Group]:
        """The groups described by q_groups, checked against k and q_weight's rows."""
        check_tensor(name, "q_groups", self.q_groups, (torch.int16,), ndim=1)
        check_tensor(name, "q_weight", self.q_weight, (torch.int32,), ndim=2)
        check_tensor(name, "q_invperm", self.q_invperm, (torch.int32,), ndim=1)
        pairs = self.q_groups.tolist()
        if len(pairs) < 2 or len(pairs) % 2:
            fail(name, "q_groups", f"must hold (bits, offset) pairs, got {len(pairs)} values")
        bits = pairs[0::2]
        # exllamav2 reads the offsets as uint16; they stay below 2^14 for any legal k.
        offsets = [o & 0xFFFF for o in pairs[1::2]]
        k, total_qrows = self.in_features, self.q_weight.shape[0]
        for g, b in enumerate(bits):
            if b not in EXL2_BITS:
                fail(name, "q_groups", f"group {g} has {b} bits; EXL2 groups have 2-6 or 8 bits")
            if g and b > bits[g - 1]:
                fail(
                    name,
                    "q_groups",
                    f"group bits must be non-increasing, got {bits[g - 1]} then {b}",
                )
        if offsets[0] != 0:
            fail(name, "q_groups", f"group 0 must start at q_weight row 0, got {offsets[0]}")
        out: list[Exl2Group] = []
        row = 0
        for g, b in enumerate(bits):
            qa = offsets[g]
            last = g == len(bits) - 1
            if not last:
                qb = offsets[g + 1]
                step = exl2_group_rows_multiple(b)
                if qb <= qa or ((qb - qa) * 32) % (b * step):
                    fail(
                        name,
                        "q_groups",
                        f"group {g} spans q_weight rows {qa}..{qb}, not a positive multiple of "
                        f"{step} rows at {b} bits",
                    )
                rows = (qb - qa) * 32 // b
            else:
                rows = k - row
                if rows <= 0:
                    fail(name, "q_groups", f"groups 0..{g - 1} already cover {row} of {k} rows")
                qb = qa + packed_rows(rows, b)
                if qb != total_qrows:
                    fail(
                        name,
                        "q_groups",
                        f"last group starts at q_weight row {qa} and packs {rows} rows at {b} "
                        f"bits into {qb - qa} rows, but q_weight has {total_qrows} rows",
                    )
            out.append(Exl2Group(b, row, row + rows, qa, qb))
            row += rows
        return out

    def validate(self, name: str, in_features: int, out_features: int) -> None:
        """Raise QuantFormatError naming the tensor if this is not a valid EXL2 linear."""
        k, n = in_features, out_features
        if not 0 < k <= EXL2_MAX_IN_FEATURES:
            fail(
                name,
                "q_invperm",
                f"in_features must be 1..{EXL2_MAX_IN_FEATURES}, got {k} "
                "(exllamav2 stores permutation indices as uint16)",
            )
        check_tensor(name, "q_weight", self.q_weight, (torch.int32,), ndim=2)
        check_tensor(name, "q_invperm", self.q_invperm, (torch.int32,), shape=(k,))
        w, padded = self.width, -(-n // 32) * 32
        if w not in (n, padded):
            fail(
                name,
                "q_weight",
                f"has {w} columns; expected out_features {n} or {padded} (padded to 32)",
            )
        if w % 8:
            fail(name, "q_weight", f"{w} columns is not a multiple of 8 (q_scale packs 8 a word)")
        groups = self.groups(name)
        g = len(groups)
        check_tensor(name, "q_scale", self.q_scale, (torch.int32,), shape=(g, w // 8))
        check_tensor(name, "q_scale_max", self.q_scale_max, (torch.float16,), shape=(g,))
        if not bool(torch.isfinite(self.q_scale_max).all()):
            fail(name, "q_scale_max", "holds a non-finite value")
        check_permutation(name, "q_invperm", self.q_invperm, k)
        if self.q_perm is not None:
            check_tensor(name, "q_perm", self.q_perm, (torch.int16, torch.int32, torch.int64), (k,))
        if self.bias is not None:
            check_tensor(name, "bias", self.bias, _FLOATS, ndim=1)
            if self.bias.shape[0] not in (n, w):
                want = f"[{n}]" if n == w else f"[{n}] or [{w}]"
                fail(name, "bias", f"shape must be {want}, got {list(self.bias.shape)}")


def exl2_scales(q_scale: torch.Tensor, q_scale_max: torch.Tensor, width: int) -> torch.Tensor:
    """fp16 [G, width] scales, rounded as exllamav2 rounds them (see the module docstring)."""
    s = unpack_along_columns(q_scale, 4, width).to(torch.int32)
    squares = ((s + 1) * (s + 1)).to(torch.float16)  # <= 256: exact
    premultiplied = (q_scale_max.float() / 256).to(torch.float16)
    # The fp32 product of two fp16 values is exact, so one cast gives fp16's rounded product.
    return (squares.float() * premultiplied.float()[:, None]).to(torch.float16)


def _bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    # The converter writes the bias unpadded even when it pads q_weight's columns.
    if bias is None:
        return None
    return torch.nn.functional.pad(bias[:n].to(torch.float16), (0, n - min(n, len(bias))))


def dequantize_exl2(t: Exl2Tensors, out_features: int | None = None) -> torch.Tensor:
    """The reference: fp32 [k, n] in the original row order (n = out_features or the width)."""
    n = t.width if out_features is None else out_features
    scales = exl2_scales(t.q_scale, t.q_scale_max, t.width)
    w_stored = torch.empty(t.in_features, t.width, dtype=torch.float32, device=t.q_weight.device)
    for g, grp in enumerate(t.groups()):
        rows = grp.row_end - grp.row_start
        codes = unpack_bitstream(t.q_weight[grp.qrow_start : grp.qrow_end], grp.bits, rows)
        signed = codes.float() - 2 ** (grp.bits - 1)
        w_stored[grp.row_start : grp.row_end] = signed * scales[g].float()
    # W[q_perm[r]] = w_stored[r]  <=>  W[j] = w_stored[q_invperm[j]]
    return w_stored[t.q_invperm.long(), :n].contiguous()


def exl2_row_group(groups: list[Exl2Group], device: torch.device) -> torch.Tensor:
    """int32 [k]: the group of each stored row (the runtime keeps the stored row order)."""
    rows_per_group = torch.tensor([g.row_end - g.row_start for g in groups], device=device)
    return torch.repeat_interleave(
        torch.arange(len(groups), dtype=torch.int32, device=device), rows_per_group
    )


def exl2_to_runtime(t: Exl2Tensors, out_features: int | None = None) -> QuantizedWeight:
    """Convert to the runtime layout: one Segment per run of equal bits, fp16 scales, compact
    zero points."""
    k = t.in_features
    n = t.width if out_features is None else out_features
    groups = t.groups()
    invperm = t.q_invperm.long()
    perm = torch.argsort(invperm)
    identity = bool((perm == torch.arange(k, device=perm.device)).all())

    scales = exl2_scales(t.q_scale, t.q_scale_max, t.width)[:, :n].contiguous()
    # The zero point in code units, 2^(bits-1): exact in fp16.
    zero_codes = torch.tensor([2.0 ** (g.bits - 1) for g in groups], device=scales.device)
    zeros = compact_zero_points(zero_codes[:, None].expand(-1, scales.shape[1]))
    row_group = exl2_row_group(groups, scales.device)

    segments: list[Segment] = []
    i = 0
    while i < len(groups):
        j = i
        while j + 1 < len(groups) and groups[j + 1].bits == groups[i].bits:
            j += 1
        bits, a, b = groups[i].bits, groups[i].row_start, groups[j].row_end
        # Groups before the last fill whole words, so a run of equal bits is one stream.
        packed = t.q_weight[groups[i].qrow_start : groups[j].qrow_end]
        if bits in (2, 4, 8):
            # The stream at a power-of-two width is already the plane layout.
            segments.append(Segment(bits, a, b, [Plane(bits, 0, packed[:, :n].contiguous())]))
        else:
            codes = unpack_bitstream(packed, bits, b - a)[:, :n]
            segments.append(make_segment(codes, bits, a))
        i = j + 1

    return QuantizedWeight(
        in_features=k,
        out_features=n,
        perm=None if identity else perm.to(torch.int32),
        segments=segments,
        scales=scales,
        zeros=zeros,
        row_group=row_group,
        bias=_bias(t.bias, n),
    )
