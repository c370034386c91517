"""Quantized matmul: the runtime weight layout (its references: reference.py).

Contract (docs/quant_layout.md; k = in_features, n = out_features):

    QuantizedWeight
      perm       int32 [k] or None   the kernel reads x[:, perm[i]] as its row i (act-order)
      segments   list[Segment]       row ranges of one bit width covering 0..k-1, in order
      scales     fp16 [G, n]
      zeros      uint8/int16/fp16 [G, n]  zero points in code units, so w = (code - zero) *
                 scale; integers (GPTQ, EXL2: 0..256) in the smallest type that holds them
                 (`compact_zero_points`: a 4-bit GPTQ 8B model's zeros take 52 MiB, not 104).
                 Contiguous, or one zero point per group: a [G] vector expanded along n
                 (strides (1, 0)), which EXL2 (2^(bits-1)) and symmetric GPTQ (2^(bits-1)
                 everywhere) always are: G bytes instead of G * n.
      row_group  int32 [k]           group of each permuted row, non-decreasing
      bias       fp16 [n] or None
    Segment: bits in {2, 3, 4, 5, 6, 8}, rows [row_start, row_end), planes per PLANE_SPLITS
    Plane:   bits in {1, 2, 4, 8}, shift, packed int32 [ceil(rows / (32 / bits)), n]; row r
             of the segment sits in word r // (32 / bits) at bit (r % (32 / bits)) * bits

Everything format-specific (EXL2, GPTQ files) lives in engine/quant/, which converts each
file format into this layout; this module knows only the layout. The plane packing is
defined here, beside the kernels that read it, and engine/quant/bitpack.py re-exports it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

#: How a code of each width is split into power-of-two planes: (plane bits, shift) pairs,
#: high bits first. No plane straddles a 32-bit word, and the planes hold exactly the
#: file's bits (nothing is widened).
PLANE_SPLITS: dict[int, tuple[tuple[int, int], ...]] = {
    8: ((8, 0),),
    6: ((4, 2), (2, 0)),
    5: ((4, 1), (1, 0)),
    4: ((4, 0),),
    3: ((2, 1), (1, 0)),
    2: ((2, 0),),
}
PLANE_BITS = (1, 2, 4, 8)


def _to_int32_words(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> int32 with the same 32 bits (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_plane(codes: torch.Tensor, bits: int, shift: int = 0) -> torch.Tensor:
    """Pack unsigned codes [rows, n] (< 2^bits) of one plane into int32 [ceil(rows*bits/32), n].
    With `shift`, the plane is bits [shift, shift + bits) of wider codes (a Segment's plane,
    see PLANE_SPLITS), taken without a full-size copy of the shifted codes."""
    if bits not in PLANE_BITS:
        raise ValueError(f"plane bits must be one of {PLANE_BITS}, got {bits}")
    if codes.dim() != 2 or codes.is_floating_point():
        raise ValueError(f"codes must be a 2-D integer tensor, got {codes.dtype} {codes.shape}")
    per_word = 32 // bits
    rows, n = codes.shape
    words = -(-rows // per_word)
    mask = (1 << bits) - 1
    padded = torch.zeros(words * per_word, n, dtype=torch.uint8, device=codes.device)
    body = padded[:rows]
    if codes.dtype == torch.uint8:  # in place: no temporary as large as the codes
        torch.bitwise_right_shift(codes, shift, out=body)
        body &= mask
    else:
        body.copy_((codes >> shift) & mask)
    if sys.byteorder != "little":  # the byte view below reads words little-endian
        padded = padded.view(words, per_word, n)
        acc = torch.zeros(words, n, dtype=torch.int64, device=codes.device)
        for j in range(per_word):
            acc |= padded[:, j].long() << (j * bits)
        return _to_int32_words(acc)
    # Byte by byte in uint8 (a few passes over the codes, not per_word passes in int64:
    # loading an EXL2 model repacks billions of codes, on the GPU or, when it is out of
    # memory, the CPU): byte b of a word holds
    # its codes b * per_byte .. (b + 1) * per_byte - 1, low bits first; the 4 bytes of each
    # word are then made adjacent and read as one little-endian int32.
    per_byte = 8 // bits
    grouped = padded.view(words, 4, per_byte, n)
    byte = grouped[:, :, 0].clone()
    for i in range(1, per_byte):
        byte |= grouped[:, :, i] << (i * bits)
    return byte.permute(0, 2, 1).contiguous().view(words * n, 4).view(torch.int32).view(words, n)


def unpack_plane(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Inverse of pack_plane: int32 [ceil(rows*bits/32), n] -> uint8 codes [rows, n]."""
    if bits not in PLANE_BITS:
        raise ValueError(f"plane bits must be one of {PLANE_BITS}, got {bits}")
    per_word = 32 // bits
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D int32 tensor, got {packed.dtype} {packed.shape}")
    if packed.shape[0] != -(-rows // per_word):
        raise ValueError(f"{rows} rows at {bits} bits need {-(-rows // per_word)} words")
    mask = (1 << bits) - 1
    # Arithmetic right shifts of int32 copy the sign bit down; the mask drops those copies.
    parts = [((packed >> (j * bits)) & mask).to(torch.uint8) for j in range(per_word)]
    return torch.stack(parts, dim=1).reshape(-1, packed.shape[1])[:rows]


@dataclass
class Plane:
    bits: int  # 1, 2, 4 or 8
    shift: int  # where the plane's bits sit in the code
    packed: torch.Tensor  # int32 [ceil(rows / (32 / bits)), n]


@dataclass
class Segment:
    bits: int  # 2, 3, 4, 5, 6 or 8
    row_start: int
    row_end: int
    planes: list[Plane]

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    def codes(self) -> torch.Tensor:
        """The segment's unsigned codes, int32 [rows, n]."""
        code = None
        for plane in self.planes:
            part = unpack_plane(plane.packed, plane.bits, self.rows).to(torch.int32) << plane.shift
            code = part if code is None else code | part
        assert code is not None
        return code


def _require(cond: bool, message: str) -> None:
    # Hard asserts that survive `python -O`: a malformed packed tensor must never reach a
    # kernel, where it would read out of bounds or silently produce garbage.
    if not cond:
        raise AssertionError(f"QuantizedWeight: {message}")


ZERO_POINT_DTYPES = (torch.uint8, torch.int16, torch.float16)


def compact_zero_points(zeros: torch.Tensor) -> torch.Tensor:
    """Zero points [G, n] in the smallest of ZERO_POINT_DTYPES that holds them exactly:
    uint8 for integers in 0..255, int16 for other integers (GPTQ's 8-bit zero point can be
    256), fp16 otherwise. The kernels read any of them and compute in float32. When every
    group has one zero point for all its columns (EXL2, symmetric GPTQ), only that column
    is stored and expanded along n (see `per_group_zeros`)."""
    values = zeros.float()
    if values.dim() == 2 and values.shape[1] > 1 and bool((values == values[:, :1]).all()):
        column = compact_zero_points(zeros[:, :1]).reshape(-1).contiguous()
        return column.view(-1, 1).expand(zeros.shape)
    if values.numel() and bool((values == values.round()).all()):
        low, high = float(values.min()), float(values.max())
        if 0 <= low and high <= 255:
            return zeros.to(torch.uint8).contiguous()
        if -(2**15) <= low and high < 2**15:
            return zeros.to(torch.int16).contiguous()
    return zeros.to(torch.float16).contiguous()


def per_group_zeros(zeros: torch.Tensor) -> bool:
    """Whether `zeros` [G, n] stores one zero point per group: a contiguous [G] expanded
    along n (the kernels then read zeros[group] instead of zeros[group, column])."""
    if zeros.dim() != 2 or zeros.shape[1] < 2 or zeros.stride(1) != 0:
        return False
    return zeros.shape[0] == 1 or zeros.stride(0) == 1  # a dimension of 1 has any stride


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes of memory `t` spans: numel * element size for a contiguous tensor, the
    stored column only for expanded per-group zero points."""
    if t.numel() == 0:
        return 0
    steps = zip(t.shape, t.stride(), strict=True)
    span = 1 + sum((size - 1) * abs(stride) for size, stride in steps)
    return span * t.element_size()


def _move_zeros(zeros: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    # Tensor.to would materialize the expansion into G * n elements on the new device.
    if per_group_zeros(zeros):
        return zeros[:, :1].to(device).expand(zeros.shape)
    return zeros.to(device)


@dataclass
class QuantizedWeight:
    in_features: int
    out_features: int
    perm: torch.Tensor | None
    segments: list[Segment]
    scales: torch.Tensor
    zeros: torch.Tensor
    row_group: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def num_groups(self) -> int:
        return self.scales.shape[0]

    @property
    def device(self) -> torch.device:
        return self.scales.device

    def validate(self) -> None:
        """Check every shape, dtype and range the kernels rely on (AssertionError if not)."""
        k, n = self.in_features, self.out_features
        _require(k > 0 and n > 0, f"in/out features must be positive, got {k}, {n}")
        dev = self.scales.device

        def check(t: torch.Tensor, what: str, dtype: torch.dtype, shape: tuple) -> None:
            _require(t.dtype == dtype, f"{what} must be {dtype}, got {t.dtype}")
            _require(tuple(t.shape) == shape, f"{what} must have shape {shape}, got {t.shape}")
            _require(t.device == dev, f"{what} is on {t.device}, scales on {dev}")
            _require(t.is_contiguous(), f"{what} must be contiguous")

        g = self.scales.shape[0] if self.scales.dim() == 2 else -1
        _require(g >= 1, f"scales must be [G, n] with G >= 1, got {self.scales.shape}")
        check(self.scales, "scales", torch.float16, (g, n))
        _require(
            self.zeros.dtype in ZERO_POINT_DTYPES,
            f"zeros must be one of {ZERO_POINT_DTYPES}, got {self.zeros.dtype}",
        )
        shape = tuple(self.zeros.shape)
        _require(shape == (g, n), f"zeros must have shape {(g, n)}, got {shape}")
        _require(self.zeros.device == dev, f"zeros is on {self.zeros.device}, scales on {dev}")
        _require(
            self.zeros.is_contiguous() or per_group_zeros(self.zeros),
            f"zeros must be contiguous or one per group (strides (1, 0)), got strides "
            f"{self.zeros.stride()}",
        )
        check(self.row_group, "row_group", torch.int32, (k,))
        if self.bias is not None:
            check(self.bias, "bias", torch.float16, (n,))
        if self.perm is not None:
            check(self.perm, "perm", torch.int32, (k,))
            seen = torch.zeros(k, dtype=torch.int32, device=dev)
            ok = bool(((self.perm >= 0) & (self.perm < k)).all())
            _require(ok, "perm has indices outside 0..k-1")
            seen.index_add_(0, self.perm.long(), torch.ones_like(self.perm))
            _require(bool((seen == 1).all()), "perm is not a permutation of 0..k-1")
        rg = self.row_group
        _require(int(rg.min()) >= 0 and int(rg.max()) < g, "row_group outside 0..G-1")
        _require(bool((rg[1:] >= rg[:-1]).all()), "row_group must be non-decreasing")

        row = 0
        for i, seg in enumerate(self.segments):
            what = f"segments[{i}]"
            _require(seg.bits in PLANE_SPLITS, f"{what}.bits must be 2-6 or 8, got {seg.bits}")
            _require(seg.row_start == row, f"{what} starts at {seg.row_start}, expected {row}")
            _require(seg.row_end > seg.row_start, f"{what} is empty")
            split = tuple((p.bits, p.shift) for p in seg.planes)
            _require(
                split == PLANE_SPLITS[seg.bits],
                f"{what} planes {split} must be {PLANE_SPLITS[seg.bits]} for {seg.bits} bits",
            )
            for j, p in enumerate(seg.planes):
                words = -(-seg.rows // (32 // p.bits))
                check(p.packed, f"{what}.planes[{j}].packed", torch.int32, (words, n))
            # A group never spans two bit widths: the kernel picks bits per segment and
            # scales per group.
            if seg.row_start > 0:
                _require(
                    int(rg[seg.row_start]) != int(rg[seg.row_start - 1]),
                    f"{what} starts inside group {int(rg[seg.row_start])}",
                )
            row = seg.row_end
        _require(row == k, f"segments cover rows 0..{row}, expected 0..{k}")

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the weight holds (codes of every plane, scales, zeros, groups,
        permutation, bias): what its memory is."""
        held = [p.packed for s in self.segments for p in s.planes]
        held += [self.scales, self.zeros, self.row_group]
        return held + [t for t in (self.perm, self.bias) if t is not None]

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """A copy with every tensor on `device` (the same object's tensors if already there)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        segments = [
            Segment(
                s.bits,
                s.row_start,
                s.row_end,
                [Plane(p.bits, p.shift, p.packed.to(device)) for p in s.planes],
            )
            for s in self.segments
        ]
        return QuantizedWeight(
            in_features=self.in_features,
            out_features=self.out_features,
            perm=move(self.perm),
            segments=segments,
            scales=self.scales.to(device),
            zeros=_move_zeros(self.zeros, device),
            row_group=self.row_group.to(device),
            bias=move(self.bias),
        )
