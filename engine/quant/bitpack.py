"""Bit layouts of quantized codes: one function pair per layout, shared by readers and writers.

All codes are unsigned integers; packed words are int32 tensors holding 32 raw bits (read as
uint32). Unpacking returns uint8 codes (every width here is at most 8 bits).

1. The little-endian bit stream, packed along axis 0 (`pack_bitstream`/`unpack_bitstream`):
   codes [rows, n] at b bits -> int32 [ceil(rows * b / 32), n]. Column by column, row i of
   the matrix occupies bits [i*b, (i+1)*b) of the stream formed by words 0, 1, 2, ... (bit j
   of the stream is bit j % 32 of word j // 32). Codes straddle words where 32 % b != 0.
   Every 32 rows fill exactly b words, so the stream is a sequence of 32-row blocks.

   - EXL2 q_weight is this stream per group (bits 2, 3, 4, 5, 6, 8), as exllamav2's
     pack_columns (exllamav2_ext/cuda/pack_tensor.cu) writes it. Its kernel packs in
     whole-word blocks of 16 rows at 2 bits (1 word), 32 at 3 (3 words), 8 at 4 (1 word),
     32 at 5 (5 words), 16 at 6 (3 words) and 4 at 8 (1 word): all of them are this same
     stream, only the block granularity differs. "16 rows for 2-bit" in the reference only
     means a 2-bit group may end after 16 rows (one whole word); the kernels still require
     every group but the last to be a multiple of 32 rows (16 at 2 bits).
   - GPTQ qweight at 4 and 8 bits is the same stream (8 or 4 codes per word, row j of a word
     at bits j*b), and so is each runtime plane (below).
   - Packed along axis 1 instead (`pack_along_columns`): EXL2 q_scale (4-bit scale codes,
     column c at bits 4*(c % 8) of word c // 8) and GPTQ qzeros.

2. Kestrel's runtime planes (docs/quant_layout.md): power-of-two widths 1/2/4/8, so no code
   straddles a word; defined in kernels.quant_matmul.layout (pack_plane, unpack_plane, PLANE_SPLITS)
   beside the kernels that read them and re-exported here. For these widths the plane
   layout is bit for bit the stream of (1). `make_segment` splits codes into planes.
"""

from __future__ import annotations

import torch

from kernels.quant_matmul.layout import PLANE_SPLITS, Plane, Segment, pack_plane, unpack_plane

__all__ = [
    "PLANE_SPLITS",
    "make_segment",
    "pack_along_columns",
    "pack_bitstream",
    "pack_plane",
    "packed_rows",
    "unpack_along_columns",
    "unpack_bitstream",
    "unpack_plane",
]


def packed_rows(rows: int, bits: int) -> int:
    """Words (int32 rows) that `rows` codes of `bits` bits occupy in the stream."""
    return -(-rows * bits // 32)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8, got {bits}")


def _check_codes(codes: torch.Tensor, bits: int) -> None:
    if codes.dim() != 2 or codes.is_floating_point() or codes.dtype == torch.bool:
        raise ValueError(f"codes must be a 2-D integer tensor, got {codes.dtype} {codes.shape}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(
            f"codes must lie in 0..{(1 << bits) - 1} for {bits} bits, "
            f"got {int(codes.min())}..{int(codes.max())}"
        )


def pack_bitstream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes [rows, n] (0 <= code < 2^bits) along axis 0 -> int32 [packed_rows, n]."""
    _check_bits(bits)
    _check_codes(codes, bits)
    rows, n = codes.shape
    blocks = -(-rows // 32)
    padded = torch.zeros(blocks * 32, n, dtype=codes.dtype, device=codes.device)
    padded[:rows] = codes
    padded = padded.view(blocks, 32, n)
    # int64 accumulators: a code shifted into the top bits of a word must not overflow.
    # Only one 32nd of the codes is widened at a time.
    acc = torch.zeros(blocks, bits, n, dtype=torch.int64, device=codes.device)
    for i in range(32):
        word, shift = divmod(i * bits, 32)
        code = padded[:, i].long()
        acc[:, word] |= (code << shift) & 0xFFFFFFFF
        if shift + bits > 32:  # the code straddles into the next word
            acc[:, word + 1] |= code >> (32 - shift)
    acc = acc.view(blocks * bits, n)[: packed_rows(rows, bits)]
    return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)


def unpack_bitstream(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Inverse of pack_bitstream: int32 [packed_rows(rows, bits), n] -> uint8 [rows, n]."""
    _check_bits(bits)
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D int32 tensor, got {packed.dtype} {packed.shape}")
    if packed.shape[0] != packed_rows(rows, bits):
        raise ValueError(
            f"{rows} rows at {bits} bits pack into {packed_rows(rows, bits)} words, "
            f"got {packed.shape[0]}"
        )
    n = packed.shape[1]
    blocks = -(-rows // 32)
    words = torch.zeros(blocks * bits, n, dtype=torch.int32, device=packed.device)
    words[: packed.shape[0]] = packed
    words = words.view(blocks, bits, n)
    out = torch.empty(blocks, 32, n, dtype=torch.uint8, device=packed.device)
    for i in range(32):
        word, shift = divmod(i * bits, 32)
        low_bits = min(bits, 32 - shift)
        # int32 >> is arithmetic (it copies the sign bit down); masking right after the
        # shift keeps only bits that came from the word itself.
        value = (words[:, word] >> shift) & ((1 << low_bits) - 1)
        if low_bits < bits:
            high = words[:, word + 1] & ((1 << (bits - low_bits)) - 1)
            value |= high << low_bits
        out[:, i] = value.to(torch.uint8)
    return out.view(blocks * 32, n)[:rows]


def pack_along_columns(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes [m, cols] along axis 1 -> int32 [m, ceil(cols * bits / 32)].

    Column c sits at stream bit c * bits of its row (EXL2 q_scale, GPTQ qzeros).
    """
    return pack_bitstream(codes.t(), bits).t().contiguous()


def unpack_along_columns(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Inverse of pack_along_columns -> uint8 [m, cols]."""
    return unpack_bitstream(packed.t().contiguous(), bits, cols).t().contiguous()


def make_segment(codes: torch.Tensor, bits: int, row_start: int) -> Segment:
    """The runtime Segment holding codes [rows, n] of `bits` bits at rows row_start.."""
    if bits not in PLANE_SPLITS:
        raise ValueError(f"segment bits must be one of {sorted(PLANE_SPLITS)}, got {bits}")
    _check_codes(codes, bits)
    planes = [Plane(pb, shift, pack_plane(codes, pb, shift)) for pb, shift in PLANE_SPLITS[bits]]
    return Segment(bits, row_start, row_start + codes.shape[0], planes)
