"""The tile helpers that the attention kernels share (kernels/attention/decode.py and
prefill.py): where a key's slot lies in the paged cache (`kv_token_offsets`), a K or V tile
loaded and dequantized from any storage format (`load_kv_tile`: the one place that knows
how the cache stores a token), scores in log2 units with the optional softcap
(`scores_log2`), the float32-accumulating MMA (`mma`), and the host side of their
constexprs (`storage_constants`, `score_constants`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.backend import is_interpreted
from kernels.kv_quant import KIND_CODES, KVFormat

LOG2E = 1.4426950408889634


@triton.jit
def kv_token_offsets(
    page_table_row,  # pointer to this sequence's page ids
    key_pos,  # [BLOCK_N] int32 token positions
    key_mask,  # [BLOCK_N] positions that exist (others must not touch the page table)
    stride_page,
    stride_slot,
    PAGE_SIZE: tl.constexpr,
):
    """Element offset of each key's slot in the cache ([BLOCK_N] int64), head 0, dim 0.

    One page-table read per key rather than per block: a block may span pages of any size,
    and the repeated ids hit L1.
    """
    page = tl.load(page_table_row + key_pos // PAGE_SIZE, mask=key_mask, other=0)
    # int64: a 40 GB cache has more elements than int32 can address.
    return page.to(tl.int64) * stride_page + (key_pos % PAGE_SIZE).to(tl.int64) * stride_slot


@triton.jit
def load_kv_tile(
    cache_ptr,
    token_offsets,
    dims,
    mask,
    COMPUTE_DTYPE: tl.constexpr,
    KIND: tl.constexpr = 0,
    CODE_BYTES: tl.constexpr = 0,
    GROUP_SIZE: tl.constexpr = 1,
    key_mask=None,
    HEAD_DIM: tl.constexpr = 0,
    BLOCK_N: tl.constexpr = 0,
    BLOCK_D: tl.constexpr = 0,
):
    """[BLOCK_N, BLOCK_D] tile of K or V in COMPUTE_DTYPE (q's dtype); masked entries are 0.

    `cache_ptr` points at the kv head's dim 0 (its byte 0 for a quantized cache). The
    storage hook (layouts: kernels.kv_quant): KIND 0 is a plain gather of a native cache;
    1 (fp8 e4m3), 2 (int8), 3 (int4) and 4 (int6) dequantize bytes with the row's float16 scales,
    which follow CODE_BYTES code bytes, one per GROUP_SIZE dims. Rotated formats stay
    rotated: the caller rotates q and the output instead.

    Quantized rows start 16-byte aligned (KVFormat.row_bytes), so codes are loaded as
    contiguous runs (int4: [BLOCK_N, BLOCK_D / 2] bytes, split into nibbles and interleaved
    with tl.join) and the scales as [BLOCK_N, groups], broadcast over their groups by a
    reshape, instead of one byte and one scale gather per element.
    """
    if KIND == 0:
        tile = tl.load(cache_ptr + token_offsets[:, None] + dims[None, :], mask=mask, other=0.0)
        return tile.to(COMPUTE_DTYPE)
    else:
        row = cache_ptr + token_offsets
        scale_ptr = (row + CODE_BYTES).to(tl.pointer_type(tl.float16))
        if KIND == 3 or KIND == 4:
            HALF: tl.constexpr = BLOCK_D // 2
            half = tl.arange(0, HALF)
            byte_mask = key_mask[:, None] & (half < HEAD_DIM // 2)[None, :]
            packed = tl.load(row[:, None] + half[None, :], mask=byte_mask, other=0).to(tl.int32)
            # Dim 2j is byte j's low nibble, dim 2j + 1 its high one.
            codes = tl.reshape(tl.join(packed & 15, (packed >> 4) & 15), (BLOCK_N, BLOCK_D))
            if KIND == 4:
                # int6: the high bit pairs follow the nibble plane (head_dim / 2 bytes,
                # two thirds of the code bytes).
                high_ptrs = row[:, None] + (CODE_BYTES * 2 // 3 + dims // 4)[None, :]
                high = tl.load(high_ptrs, mask=mask, other=0)
                codes |= ((high >> ((dims & 3) * 2)[None, :]) & 3).to(tl.int32) << 4
                values = (codes - 32).to(tl.float32)
            else:
                values = (codes - 8).to(tl.float32)
        else:
            codes = tl.load(row[:, None] + dims[None, :], mask=mask, other=0)
            if KIND == 2:
                values = (codes.to(tl.int32) - 128).to(tl.float32)
            else:
                # e4m3 -> float16 bits: the 7 magnitude bits land on float16's exponent and
                # mantissa fields (the exponent bias differs by 8), subnormals included; the
                # missing 2^8 goes into the scale.
                bits = ((codes & 0x7F).to(tl.int16) << 7) | ((codes & 0x80).to(tl.int16) << 8)
                values = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        if BLOCK_D % GROUP_SIZE == 0:
            GROUPS: tl.constexpr = BLOCK_D // GROUP_SIZE
            grp = tl.arange(0, GROUPS)
            scale_mask = key_mask[:, None] & (grp < HEAD_DIM // GROUP_SIZE)[None, :]
            scale = tl.load(scale_ptr[:, None] + grp[None, :], mask=scale_mask, other=0.0)
            grouped = tl.reshape(values, (BLOCK_N, GROUPS, GROUP_SIZE))
            values = tl.reshape(grouped * scale.to(tl.float32)[:, :, None], (BLOCK_N, BLOCK_D))
        else:  # fp8 of a head_dim that is no power of two: one scale per row, gathered
            scale = tl.load(
                scale_ptr[:, None] + (dims // GROUP_SIZE)[None, :], mask=mask, other=0.0
            )
            values = values * scale.to(tl.float32)
        return tl.where(mask, values, 0.0).to(COMPUTE_DTYPE)


@triton.jit
def _tanh(x):
    # tanh from exp: exact limits (exp overflow gives 1, underflow -1), absolute error
    # ~1e-7, and no libdevice dependency (the interpreter runs it too).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def scores_log2(qk, score_scale, softcap_log2, SOFTCAP: tl.constexpr):
    """Raw q.k (float32) to logits in log2 units.

    Without softcap `score_scale` = scale * log2(e); with it `score_scale` = scale / cap and
    `softcap_log2` = cap * log2(e), so cap * tanh(scale * qk / cap) comes out in log2 units.
    """
    if SOFTCAP:
        return softcap_log2 * _tanh(qk * score_scale)
    else:
        return qk * score_scale


@triton.jit
def mma(a, b, F32_OPERANDS: tl.constexpr):
    """a @ b accumulated in float32.

    F32_OPERANDS: float32 inputs, or any inputs in the interpreter (whose dot multiplies
    bfloat16's raw uint16 storage as integers in Triton 3.6). On the GPU float32 goes
    through "tf32x3" (three tf32 MMAs, float32 accuracy, tensor cores): "ieee" tiles of
    this size spill registers heavily on sm_90.
    """
    if F32_OPERANDS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    else:
        return tl.dot(a, b)


# Triton 3.6's interpreter truncates float32 -> bfloat16 and multiplies bfloat16 dots as
# integers: see kernels.backend.cast_rtne and mma.
INTERPRETED = is_interpreted(load_kv_tile)


def storage_constants(k_format: KVFormat, v_format: KVFormat, head_dim: int) -> dict[str, int]:
    """The K_*/V_* constexprs of the attention kernels for the cache's storage formats."""
    consts = {}
    for prefix, fmt in (("K", k_format), ("V", v_format)):
        consts[f"{prefix}_KIND"] = KIND_CODES[fmt.kind]
        consts[f"{prefix}_CODE_BYTES"] = fmt.code_bytes(head_dim) if fmt.quantized else 0
        consts[f"{prefix}_GROUP"] = fmt.group_size(head_dim) if fmt.quantized else 1
    return consts


def score_constants(scale: float, softcap: float | None) -> tuple[float, float]:
    """(score_scale, softcap_log2) for `scores_log2`."""
    if softcap is None:
        return float(scale) * LOG2E, 0.0
    return float(scale) / float(softcap), float(softcap) * LOG2E
