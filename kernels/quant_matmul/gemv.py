"""The decode GEMV of the quantized matmul: y = x @ W + bias for 1-4 rows of x, one fused
dequantizing kernel per segment (`_gemv_kernel`, launched by `launch_gemv`). The design is
in kernels/quant_matmul/__init__.py's docstring; `GemvConfig` holds its launch settings
(tools/tune_gemv.py sweeps them), `gemv_tiling` how one call splits its work.
kernels/quant_matmul/gemv_share.py opens the same launch to other kernels' partials (LoRA).

An RMSNorm folded into this GEMV (issue 28) does no work in it: every thread loads every
row of x of its chunk (lanes and warps lie only along n), so a norm applied to x as it is
loaded (gather the weight, times rstd and w, round) was repeated by every thread and made
the 8B GEMVs 10% slower on an H100. The norm is linear in x but for its scalar rstd per
row: the previous slot sum writes x = h * w (`launch_gemv_residual`), this GEMV reads it as
any x, and its slot sum scales each output by rstd once and adds the bias after
(`launch_gemv` with a SlotNorm, kernels/quant_matmul/slot_sum.py).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.backend import (
    pdl_launch_dependents,
    pdl_wait,
    programmatic_launch,
)
from kernels.quant_matmul.layout import QuantizedWeight, per_group_zeros
from kernels.quant_matmul.slot_sum import (
    RowSquares,
    SlotNorm,
    SlotSumConfig,
    launch_slot_sum,
    launch_slot_sum_residual,
)
from kernels.quant_matmul.split_k import (
    chunks_in_groups,
    plane_args,
    plane_meta,
    sm_count,
    split_iters,
    split_k_workspace,
)
from kernels.quant_matmul.tiles import store_partial, zero_points

_GEMV_BLOCK_K = 32  # rows per chunk: the least group size of EXL2, one group per chunk


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Launch settings of the decode GEMV (`_GEMV_CONFIG`, read by `gemv_tiling`).

    num_warps: warps per program; lanes and warps lie only along n, so the sums over rows
        never leave a thread.
    cols_per_thread: by M (index M - 1). Every row of x is loaded (gathered through perm)
        by every thread, so more columns per thread share that cost, until the registers
        run out (M codes * x).
    programs_per_sm: split-K target, counted over all segments: enough resident warps to
        keep the loads in flight, few enough that the partials (n floats per split, stored
        and read back by the slot sum, kernels/quant_matmul/slot_sum.py) stay cheap next to
        the weight bytes.
    max_iters: chunks of _GEMV_BLOCK_K rows per program (a loop, not unrolled).
    prefetch: load the next chunk's packed words before working on this one (registers
        as a two-stage pipeline), so a program keeps a load in flight while it computes.
    stages: the chunk loop's software pipeline (Triton's `tl.range(num_stages=...)`): above
        1, every load of a chunk (words, x, scales) is issued `stages - 1` chunks ahead by
        cp.async into shared memory, so the bytes in flight need no registers; 1 is the
        plain loop. Only where it pays (`_gemv_stages`).
    """

    num_warps: int = 2
    cols_per_thread: tuple[int, int, int, int] = (8, 8, 4, 4)
    programs_per_sm: int = 4
    max_iters: int = 4
    prefetch: bool = False
    stages: int = 1


# tools/tune_gemv.py on an H100 (8B GPTQ shapes, every layer's weight in turn): 4 warps,
# 2 programs per SM was the best single setting (2030 us of GEMV per token against 2058 for
# the earlier 2 warps, 4 per SM). With programmatic dependent launch the prefetch lets the
# first chunk's loads start before the previous kernel has finished: decode graph replay
# 2.76 -> 2.51 ms per token (bench/results/2026-11-25-h100-ab-pdl.json, H100; greedy tokens
# identical).
# Fewer, longer splits for wide outputs (fewer slots for the slot sum to read) were
# measured slower on an H100 (issue 31, session 12: qkv 7.7 -> 10.4 us, gate_up 26.0 -> 38.0
# us, 8B decode -27%): the many short splits keep more loads in flight, so max_iters stays 4.
# Three stages where they pay (`_gemv_stages`): 8B decode graph on an H200 2.039 -> 2.017 ms
# (GPTQ) and 2.131 -> 2.111 ms (EXL2), logits bitwise equal (the same sums in the same
# order); tune_gemv's GEMVs alone 1760 -> 1685 us a token
# (bench/results/2026-11-29-h200-gemv-stages-s24.json).
_GEMV_CONFIG = GemvConfig(
    num_warps=4,
    cols_per_thread=(8, 8, 4, 4),
    programs_per_sm=2,
    max_iters=4,
    prefetch=True,
    stages=3,
)


_FLOAT_MAGIC = 0x4B000000  # the bits of 2^23 as float32


@triton.jit
def _gemv_plane_row(values, row_factor, x_ptrs, row_ok, xc, X_GIVEN: tl.constexpr):
    """sum over the chunk's rows of values * x * row_factor, for one row of x -> [N]. x is
    loaded at x_ptrs, or given (`X_GIVEN`: xc, this chunk's rows from `_gemv_x_chunk`). The
    products of a column are added in one chain over the chunk's rows."""
    if X_GIVEN:
        xv = tl.reshape(xc, [values.shape[0], values.shape[1], 1]) * row_factor
    else:
        xv = tl.load(x_ptrs, mask=row_ok, other=0.0).to(tl.float32) * row_factor  # [W, RPW, 1]
    products = values * xv
    return tl.sum(
        tl.reshape(products, [products.shape[0] * products.shape[1], products.shape[2]]), 0
    )


@triton.jit
def _gemv_x_chunk(
    x_ptr, x_row_offset, r0, k_end, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr,
    VEC_X: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The chunk's rows r0 .. r0 + BLOCK_K of one row of x, in float32, as a [BLOCK_K, 1, 1]
    tile in every thread: loaded once for every plane and the zero term. Gathered through
    perm (HAS_PERM: x_row_offset points at perm), or contiguous; `VEC_X` reads contiguous
    rows in 8-byte words (two float32 or four 16-bit rows a load, x 8-byte aligned: checked
    on the host) where a load per row costs an instruction and an address per row and
    thread."""
    if VEC_X:
        x_base = x_ptr + x_row_offset + r0
        pairs = x_base.to(tl.pointer_type(tl.int64))
        if x_ptr.dtype.element_ty == tl.float32:
            words = tl.load(pairs + tl.arange(0, BLOCK_K // 2)[:, None, None])
            lo = words.to(tl.int32).to(tl.float32, bitcast=True)
            hi = (words >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            return tl.reshape(tl.join(lo, hi), [BLOCK_K, 1, 1])
        else:
            HALF: tl.constexpr = x_ptr.dtype.element_ty
            words = tl.load(pairs + tl.arange(0, BLOCK_K // 4)[:, None, None])
            h0 = words.to(tl.int16).to(HALF, bitcast=True).to(tl.float32)
            h1 = (words >> 16).to(tl.int16).to(HALF, bitcast=True).to(tl.float32)
            h2 = (words >> 32).to(tl.int16).to(HALF, bitcast=True).to(tl.float32)
            h3 = (words >> 48).to(tl.int16).to(HALF, bitcast=True).to(tl.float32)
            return tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), [BLOCK_K, 1, 1])
    rows = r0 + tl.arange(0, BLOCK_K)[:, None, None]
    row_ok = rows < k_end
    if EVEN_K:
        row_ok = tl.full(rows.shape, True, tl.int1)
    if HAS_PERM:
        x_ptrs = x_ptr + tl.load(x_row_offset + rows, mask=row_ok, other=0)
    else:
        x_ptrs = x_ptr + x_row_offset + rows
    return tl.load(x_ptrs, mask=row_ok, other=0.0).to(tl.float32)


@triton.jit
def _gemv_plane_words(
    plane_ptr, plane_stride, r0, k_end, cols, col_ok, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    """The packed words [W, 1, N] of one plane for the chunk of rows [r0, r0 + BLOCK_K):
    r0 is a multiple of 32, hence of the rows per word, so word w of the chunk is word
    r0 / RPW + w. Words past k_end read as 0 (no memory traffic)."""
    RPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = BLOCK_K // RPW
    word = tl.arange(0, W)[:, None, None]  # [W, 1, 1]
    ptrs = plane_ptr + (r0 // RPW) * plane_stride + (word * plane_stride + cols[None, None, :])
    if EVEN_K:
        # Whole chunks only: one uniform test (the prefetch past a split's last chunk).
        return tl.load(ptrs, mask=(r0 < k_end) & col_ok[None, None, :], other=0)
    return tl.load(ptrs, mask=(r0 + word * RPW < k_end) & col_ok[None, None, :], other=0)


@triton.jit
def _gemv_plane(
    words,  # [W, 1, N] int32: _gemv_plane_words of this chunk
    x_ptr,
    stride_xm,
    x_row_offset,  # perm_ptr + row_start (HAS_PERM) or row_start
    row_group_ptr,
    scales_ptr,
    sz_stride,
    row_start,
    r0,
    k_end,
    cols,
    col_ok,
    float_magic,
    BITS: tl.constexpr,
    SHIFT: tl.constexpr,
    HAS_PERM: tl.constexpr,
    GROUPED: tl.constexpr,
    M_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PTX: tl.constexpr,
    xc0,
    xc1,
    xc2,
    xc3,
):
    """One plane's share of the chunk of rows [r0, r0 + BLOCK_K), for up to 4 rows of x.

    The chunk is a [W, RPW, N] tile: W words of RPW rows, all in the thread that owns the
    column, so the sums over rows stay in registers. Codes are read in place, which matters
    because the GEMV needs about as many instructions per byte as an SM can issue at full
    memory bandwidth: the word (or its top half, shifted down once per word) masked to the
    code's bits at position q (q + BITS <= 16) is, as a float32 bit pattern, the denormal
    code * 2^(q - 149), exactly. GPUs multiply denormals at full rate and Triton does not
    flush them, so one LOP3 and one FFMA per code and row of x do the work: x is scaled by
    2^(101 + SHIFT - q) per row (exact; finite for |x| < 2^23), the products
    x * code * 2^(SHIFT - 48) are normal floats (for |x| > 2^-78), and the caller multiplies
    the sum by 2^48 with the scale. No shift and no int-to-float conversion (a quarter-rate
    instruction) per code.

    Without GROUPED the per-row scale multiplies each code, and a denormal product would
    lose bits: there the code is OR-ed into the mantissa of 2^23 instead (2^23 + code * 2^q
    exactly, minus 2^23: one more instruction per code).

    Returns per row m of x the plane's sum_r code[r, c] * 2^SHIFT * x[m, r], times 2^-48
    (GROUPED) or with the per-row scale applied ([N] each). Rows m >= M_ROWS are copies.
    """
    RPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = BLOCK_K // RPW
    word = tl.arange(0, W)[:, None, None]  # [W, 1, 1]
    lane = tl.arange(0, RPW)[None, :, None]  # [1, RPW, 1]
    rows = r0 + word * RPW + lane  # [W, RPW, 1], segment-relative
    row_ok = rows < k_end
    if EVEN_K:
        row_ok = tl.full(rows.shape, True, tl.int1)
    cols3 = cols[None, None, :]
    col_ok3 = col_ok[None, None, :]
    position = lane * BITS
    q = position % 16
    # Codes never straddle bit 16 (BITS divides 16); an arithmetic shift's sign copies land
    # at bit 16 and above, outside every mask.
    # The top half once per word (a shift all its codes share), then one AND a code. Left to
    # LLVM, `(w >> 16) & m` becomes a shift per code (and(lshr) is canonicalised to
    # lshr(and)), so on the GPU the shift is inline PTX that it cannot see through.
    if PTX:
        top = tl.inline_asm_elementwise(
            "shr.u32 $0, $1, 16;", "=r,r", [words], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        top = (words.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
    code_bits = tl.where(position >= 16, top, words) & (((1 << BITS) - 1) << q)
    if GROUPED:
        values = code_bits.to(tl.float32, bitcast=True)  # code * 2^(q - 149), a denormal
        # 2^(101 + SHIFT - q) from its exponent bits (127 + 101 = 228): exact, constant.
        row_factor = ((228 + SHIFT - q) << 23).to(tl.float32, bitcast=True)
    else:
        # float_magic is 0x4B000000 passed at run time: as a register operand, the AND of
        # the code mask and this OR fuse into one LOP3 (an instruction takes one immediate).
        values = (code_bits | float_magic).to(tl.float32, bitcast=True) - 8388608.0
        group = tl.load(row_group_ptr + row_start + rows, mask=row_ok, other=0)
        row_scale = tl.load(
            scales_ptr + group * sz_stride + cols3, mask=row_ok & col_ok3, other=0.0
        )
        values = values * row_scale.to(tl.float32)  # code * 2^q * scale
        row_factor = ((127 + SHIFT - q) << 23).to(tl.float32, bitcast=True)  # 2^(SHIFT - q)

    if HAS_PERM:
        x_ptrs = x_ptr + tl.load(x_row_offset + rows, mask=row_ok, other=0)
    else:
        x_ptrs = x_ptr + x_row_offset + rows
    part0 = _gemv_plane_row(values, row_factor, x_ptrs, row_ok, xc0, GROUPED)
    part1 = part0
    part2 = part0
    part3 = part0
    if M_ROWS > 1:
        part1 = _gemv_plane_row(values, row_factor, x_ptrs + stride_xm, row_ok, xc1, GROUPED)
    if M_ROWS > 2:
        part2 = _gemv_plane_row(values, row_factor, x_ptrs + 2 * stride_xm, row_ok, xc2, GROUPED)
    if M_ROWS > 3:
        part3 = _gemv_plane_row(values, row_factor, x_ptrs + 3 * stride_xm, row_ok, xc3, GROUPED)
    return part0, part1, part2, part3


@triton.jit
def _gemv_zero_term(
    x_ptrs, row_ok, zero, group, group_offsets, zeros_ptr, scales_ptr, cols, col_ok, GROUPED,
    ZERO_PER_GROUP, xc, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """What the zeros take off one row of x's dot products: [N]. `zero` (GROUPED) is
    already zero point * scale, and the chunk's x is xc (`_gemv_x_chunk`), summed in every
    thread; otherwise each row's zero point and scale are loaded."""
    if GROUPED:
        # Summed from the tile plane 0 multiplies (the same layout: no shuffles).
        x_tile = tl.reshape(xc, [BLOCK_K // (32 // BITS), 32 // BITS, 1])
        return tl.sum(tl.sum(tl.sum(x_tile, axis=2), axis=1), axis=0) * zero
    else:
        xv = tl.load(x_ptrs, mask=row_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        offsets = group_offsets[:, None] + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        row_zero = zero_points(zeros_ptr, group[:, None], offsets, mask, ZERO_PER_GROUP)
        row_scale = tl.load(scales_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        return tl.sum(row_zero * row_scale * xv[:, None], axis=0)


@triton.jit
def _gemv_chunk_x(
    x_ptr, stride_xm, x_row_offset, r0, k_end, HAS_PERM: tl.constexpr, GROUPED: tl.constexpr,
    EVEN_K: tl.constexpr, VEC_X: tl.constexpr, M_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The chunk's x for each row of x (`_gemv_x_chunk`; placeholders without GROUPED)."""
    xc0 = r0  # unused without GROUPED
    xc1 = r0
    xc2 = r0
    xc3 = r0
    if GROUPED:
        # x once per chunk, for every plane and the zero term (_gemv_x_chunk).
        xc0 = _gemv_x_chunk(x_ptr, x_row_offset, r0, k_end, HAS_PERM, EVEN_K, VEC_X, BLOCK_K)
        xc1 = xc0
        xc2 = xc0
        xc3 = xc0
        if M_ROWS > 1:
            xc1 = _gemv_x_chunk(
                x_ptr + stride_xm, x_row_offset, r0, k_end, HAS_PERM, EVEN_K, VEC_X, BLOCK_K
            )
        if M_ROWS > 2:
            xc2 = _gemv_x_chunk(
                x_ptr + 2 * stride_xm, x_row_offset, r0, k_end, HAS_PERM, EVEN_K, VEC_X, BLOCK_K
            )
        if M_ROWS > 3:
            xc3 = _gemv_x_chunk(
                x_ptr + 3 * stride_xm, x_row_offset, r0, k_end, HAS_PERM, EVEN_K, VEC_X, BLOCK_K
            )
    return xc0, xc1, xc2, xc3


@triton.jit
def _gemv_chunk_scales(
    x_ptr, x_row_offset, row_group_ptr, scales_ptr, zeros_ptr, sz_stride, row_start, r0, k_end,
    cols, col_ok, offs_k, HAS_PERM: tl.constexpr, GROUPED: tl.constexpr,
    ZERO_PER_GROUP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """(scale, zero point * scale, group, group offsets, x pointers, row mask) of the chunk
    for the zero term (`_gemv_zero_term`): per column when the chunk is one group (GROUPED)."""
    rows = r0 + offs_k
    row_ok = rows < k_end
    if EVEN_K:
        row_ok = tl.full([BLOCK_K], True, tl.int1)
    if HAS_PERM:
        x_ptrs = x_ptr + tl.load(x_row_offset + rows, mask=row_ok, other=0)
    else:
        x_ptrs = x_ptr + x_row_offset + rows
    if GROUPED:
        group = tl.load(row_group_ptr + row_start + tl.minimum(r0, k_end - 1))
        sz = group * sz_stride + cols
        # 2^48 undoes the scaling of the denormal-code trick (see _gemv_plane).
        raw_scale = tl.load(scales_ptr + sz, mask=col_ok, other=0.0).to(tl.float32)
        scale = raw_scale * 2.0**48
        # zero point * scale: exact in fp32 (a small integer times an fp16 value)
        zero = zero_points(zeros_ptr, group, sz, col_ok, ZERO_PER_GROUP) * raw_scale
        group_offsets = offs_k  # unused
    else:
        scale = 1.0
        zero = 0.0
        group = tl.load(row_group_ptr + row_start + rows, mask=row_ok, other=0)
        group_offsets = group * sz_stride
    return scale, zero, group, group_offsets, x_ptrs, row_ok


@triton.jit(do_not_specialize=["add_bias", "slot_base"])
def _gemv_kernel(
    x_ptr,  # [M, k], unit column stride
    out_ptr,  # float32 [slots, M, n]: the workspace's partial slots (see store_partial)
    p0_ptr,
    p1_ptr,
    scales_ptr,
    zeros_ptr,
    row_group_ptr,
    perm_ptr,
    bias_ptr,
    n,
    stride_xm,
    p0_stride,
    p1_stride,
    sz_stride,
    row_start,  # the segment's first (permuted) row
    seg_rows,
    rows_per_split,  # ITERS * BLOCK_K
    add_bias,  # 1 for the first segment's launch of a weight with a bias (run time: one
    # compiled kernel serves every segment)
    slot_base,  # this segment's first slot: the splits of the segments launched before it
    float_magic,  # 0x4B000000 (see _gemv_plane)
    HAS_PERM: tl.constexpr,
    GROUPED: tl.constexpr,  # every chunk lies in one group (checked on the host)
    ZERO_PER_GROUP: tl.constexpr,  # zeros hold one zero point per group (per_group_zeros)
    NUM_PLANES: tl.constexpr,
    P0_BITS: tl.constexpr,
    P0_SHIFT: tl.constexpr,
    P1_BITS: tl.constexpr,
    P1_SHIFT: tl.constexpr,
    M_ROWS: tl.constexpr,  # 1..4: one accumulator each, unrolled
    ITERS: tl.constexpr,  # chunks per split (a constexpr: see the loop)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 32
    PREFETCH: tl.constexpr,  # load chunk it + 1's words before working on chunk it
    STAGES: tl.constexpr,  # the loop's software-pipeline stages (GemvConfig.stages)
    EVEN_K: tl.constexpr,  # every split has ITERS * BLOCK_K rows: no row masks
    EVEN_N: tl.constexpr,  # n is a multiple of BLOCK_N: no column masks
    VEC_X: tl.constexpr,  # x read once per chunk in 8-byte words (_gemv_x_chunk)
    PTX: tl.constexpr,  # compiled for a GPU (inline PTX), not run by the interpreter
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels.backend)
):
    pdl_launch_dependents(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # The hint keeps every [.., N] load at 4 elements per thread: the int32 words (16 bytes),
    # and the fp16 scales in the same register layout, so no tile changes layout per chunk.
    cols = tl.max_contiguous(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), 4)
    col_ok = cols < n
    if EVEN_N:
        col_ok = tl.full([BLOCK_N], True, tl.int1)
    offs_k = tl.arange(0, BLOCK_K)
    if HAS_PERM:
        x_row_offset = perm_ptr + row_start
    else:
        x_row_offset = row_start

    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    k_begin = pid_k * rows_per_split
    k_end = tl.minimum(k_begin + rows_per_split, seg_rows)
    # A constexpr trip count: Triton 3.6's interpreter fails on runtime loop bounds under
    # numpy >= 2.4 (triton-lang/triton#9171). Not unrolled: one chunk's codes already fill
    # the registers. Chunks past k_end (the tail of a segment's last split) are masked out:
    # their codes and x read as 0.
    if PREFETCH:
        next0 = _gemv_plane_words(
            p0_ptr, p0_stride, k_begin, k_end, cols, col_ok, P0_BITS, BLOCK_K, EVEN_K
        )
        next1 = next0
        if NUM_PLANES == 2:
            next1 = _gemv_plane_words(
                p1_ptr, p1_stride, k_begin, k_end, cols, col_ok, P1_BITS, BLOCK_K, EVEN_K
            )
    # Weights are never written by a kernel: their first loads above may fly while the
    # previous kernel finishes; x and the workspace only after it has.
    pdl_wait(USE_PDL)
    for it in tl.range(0, ITERS, num_stages=STAGES):
        r0 = k_begin + it * BLOCK_K
        # x first where it waits on nothing (contiguous rows): the chunk starts with it. A
        # gathered x waits on perm, and a warp issues in order: there the next chunk's words
        # go first, so that they fly while the gather waits (issue 28, session 23).
        if not HAS_PERM:
            xc0, xc1, xc2, xc3 = _gemv_chunk_x(
                x_ptr, stride_xm, x_row_offset, r0, k_end, HAS_PERM, GROUPED, EVEN_K, VEC_X,
                M_ROWS, BLOCK_K,
            )  # fmt: skip
        if PREFETCH:
            # Registers as a two-stage pipeline: this chunk's words were loaded last
            # iteration; the next chunk's loads (masked off past k_end) fly meanwhile.
            words0 = next0
            next0 = _gemv_plane_words(
                p0_ptr, p0_stride, r0 + BLOCK_K, k_end, cols, col_ok, P0_BITS, BLOCK_K, EVEN_K
            )
        else:
            words0 = _gemv_plane_words(
                p0_ptr, p0_stride, r0, k_end, cols, col_ok, P0_BITS, BLOCK_K, EVEN_K
            )
        words1 = words0
        if NUM_PLANES == 2:
            if PREFETCH:
                words1 = next1
                next1 = _gemv_plane_words(
                    p1_ptr, p1_stride, r0 + BLOCK_K, k_end, cols, col_ok, P1_BITS, BLOCK_K, EVEN_K
                )
            else:
                words1 = _gemv_plane_words(
                    p1_ptr, p1_stride, r0, k_end, cols, col_ok, P1_BITS, BLOCK_K, EVEN_K
                )
        if HAS_PERM:
            scale, zero, group, group_offsets, x_ptrs, row_ok = _gemv_chunk_scales(
                x_ptr, x_row_offset, row_group_ptr, scales_ptr, zeros_ptr, sz_stride, row_start,
                r0, k_end, cols, col_ok, offs_k, HAS_PERM, GROUPED, ZERO_PER_GROUP, EVEN_K,
                BLOCK_K,
            )  # fmt: skip
            xc0, xc1, xc2, xc3 = _gemv_chunk_x(
                x_ptr, stride_xm, x_row_offset, r0, k_end, HAS_PERM, GROUPED, EVEN_K, VEC_X,
                M_ROWS, BLOCK_K,
            )  # fmt: skip
        a0, a1, a2, a3 = _gemv_plane(
            words0,
            x_ptr,
            stride_xm,
            x_row_offset,
            row_group_ptr,
            scales_ptr,
            sz_stride,
            row_start,
            r0,
            k_end,
            cols,
            col_ok,
            float_magic,
            P0_BITS,
            P0_SHIFT,
            HAS_PERM,
            GROUPED,
            M_ROWS,
            BLOCK_K,
            EVEN_K,
            PTX,
            xc0,
            xc1,
            xc2,
            xc3,
        )
        if NUM_PLANES == 2:
            b0, b1, b2, b3 = _gemv_plane(
                words1,
                x_ptr,
                stride_xm,
                x_row_offset,
                row_group_ptr,
                scales_ptr,
                sz_stride,
                row_start,
                r0,
                k_end,
                cols,
                col_ok,
                float_magic,
                P1_BITS,
                P1_SHIFT,
                HAS_PERM,
                GROUPED,
                M_ROWS,
                BLOCK_K,
                EVEN_K,
                PTX,
                xc0,
                xc1,
                xc2,
                xc3,
            )
            a0 += b0
            a1 += b1
            a2 += b2
            a3 += b3

        if not HAS_PERM:
            scale, zero, group, group_offsets, x_ptrs, row_ok = _gemv_chunk_scales(
                x_ptr, x_row_offset, row_group_ptr, scales_ptr, zeros_ptr, sz_stride, row_start,
                r0, k_end, cols, col_ok, offs_k, HAS_PERM, GROUPED, ZERO_PER_GROUP, EVEN_K,
                BLOCK_K,
            )  # fmt: skip
        acc0 += a0 * scale - _gemv_zero_term(
            x_ptrs, row_ok, zero, group, group_offsets, zeros_ptr, scales_ptr, cols, col_ok,
            GROUPED, ZERO_PER_GROUP, xc0, P0_BITS, BLOCK_K,
        )  # fmt: skip
        if M_ROWS > 1:
            acc1 += a1 * scale - _gemv_zero_term(
                x_ptrs + stride_xm,
                row_ok,
                zero,
                group,
                group_offsets,
                zeros_ptr,
                scales_ptr,
                cols,
                col_ok,
                GROUPED,
                ZERO_PER_GROUP,
                xc1,
                P0_BITS,
                BLOCK_K,
            )
        if M_ROWS > 2:
            acc2 += a2 * scale - _gemv_zero_term(
                x_ptrs + 2 * stride_xm,
                row_ok,
                zero,
                group,
                group_offsets,
                zeros_ptr,
                scales_ptr,
                cols,
                col_ok,
                GROUPED,
                ZERO_PER_GROUP,
                xc2,
                P0_BITS,
                BLOCK_K,
            )
        if M_ROWS > 3:
            acc3 += a3 * scale - _gemv_zero_term(
                x_ptrs + 3 * stride_xm,
                row_ok,
                zero,
                group,
                group_offsets,
                zeros_ptr,
                scales_ptr,
                cols,
                col_ok,
                GROUPED,
                ZERO_PER_GROUP,
                xc3,
                P0_BITS,
                BLOCK_K,
            )

    # Split 0 of the first segment adds the bias (bias_ptr is a dummy when there is none).
    bias = tl.load(bias_ptr + cols, mask=col_ok & (pid_k == 0) & (add_bias != 0), other=0.0)
    bias = bias.to(tl.float32)
    acc0 += bias
    acc1 += bias
    acc2 += bias
    acc3 += bias
    slot = slot_base + pid_k
    slot_stride = M_ROWS * n
    store_partial(out_ptr, slot, slot_stride, cols, acc0, col_ok)
    if M_ROWS > 1:
        store_partial(out_ptr, slot, slot_stride, n + cols, acc1, col_ok)
    if M_ROWS > 2:
        store_partial(out_ptr, slot, slot_stride, 2 * n + cols, acc2, col_ok)
    if M_ROWS > 3:
        store_partial(out_ptr, slot, slot_stride, 3 * n + cols, acc3, col_ok)
    # The slot sum (kernels/quant_matmul/slot_sum.py), launched next, writes y.


def _gemv_block_n(M: int, n: int, grouped: bool, config: GemvConfig) -> int:
    """BLOCK_N of the GEMV: config.cols_per_thread[M - 1] columns on every lane of every
    warp (2 on the per-row scale path, whose gathered scales fill the registers), or less
    for a narrow n."""
    cols_per_thread = config.cols_per_thread[M - 1] if grouped else 2
    return min(cols_per_thread * 32 * config.num_warps, max(128, triton.next_power_of_2(n)))


@dataclasses.dataclass(frozen=True)
class GemvTiling:
    """How one decode GEMV splits its work: column tiles of block_n, split-K slices of
    iters chunks of block_k rows, and the programs (arrivals) of each column tile over all
    segments' launches, each with a partial slot of its own."""

    block_k: int
    block_n: int
    n_tiles: int
    iters: int
    grouped: bool
    arrivals: int
    num_warps: int
    prefetch: bool
    stages: int = 1


def gemv_tiling(
    x2d: torch.Tensor,
    qw: QuantizedWeight,
    config: GemvConfig | None = None,
    *,
    iters: int | None = None,
) -> GemvTiling:
    """The tiling of x2d [M, k] @ W under `config` (default _GEMV_CONFIG, one setting for
    every shape, tools/tune_gemv.py) with `split_iters`' chunks per split, or `iters`
    (benchmarks sweep both)."""
    M, n, k = x2d.shape[0], qw.out_features, qw.in_features
    config = config if config is not None else _GEMV_CONFIG
    block_k = _GEMV_BLOCK_K
    grouped = chunks_in_groups(qw, block_k)
    block_n = _gemv_block_n(M, n, grouped, config)
    n_tiles = triton.cdiv(n, block_n)
    if iters is None:
        iters = split_iters(
            k, n_tiles, block_k, config.programs_per_sm, config.max_iters, x2d.device
        )
    rows_per_split = iters * block_k
    arrivals = sum(
        triton.cdiv(s.row_end - s.row_start, rows_per_split)
        for s in qw.segments
        if s.row_end > s.row_start
    )
    stages = _gemv_stages(config, iters, arrivals * n_tiles, x2d.device)
    return GemvTiling(
        block_k,
        block_n,
        n_tiles,
        iters,
        grouped,
        arrivals,
        config.num_warps,
        config.prefetch,
        stages,
    )


# Programs per SM above which a launch is several waves: there the other resident programs
# already hide a program's load latency, and staged buffers (a chunk's words, 16 KB at 4
# bits and 1024 columns, per stage) only cut how many programs fit on an SM.
_STAGED_MAX_PROGRAMS_PER_SM = 8


def _gemv_stages(config: GemvConfig, iters: int, programs: int, device: torch.device) -> int:
    """The chunk loop's pipeline stages for one GEMV: config.stages where a program walks at
    least that many chunks (a shorter loop never reaches the pipeline's steady state) and
    the grid is about one wave; else 1, the plain loop. An H200 (tools/tune_gemv.py, 8B
    GPTQ, each layer's weight in turn, bench/results/2026-11-29-h200-gemv-stages-s24.json):
    down_proj 15.0 -> 13.5 us and gate_up 21.9 -> 21.0 us with 3 stages, while o_proj (2
    chunks a program) lost 7.0 -> 7.8 and the head (30 programs per SM) 82 -> 87. A gathered
    x (launch_gemv_partials) keeps the plain loop too: its loads through perm staged by
    cp.async cost EXL2's GEMVs 10-25%."""
    if config.stages <= 1 or iters < config.stages:
        return 1
    if programs > _STAGED_MAX_PROGRAMS_PER_SM * sm_count(device):
        return 1
    return config.stages


def gemv_slots(tiling: GemvTiling, extra_slots: int = 0) -> int:
    """Partial slots of one call: one per split-K program of every segment (slot =
    the program's split index over all segments' launches), then `extra_slots` for other
    kernels' terms (kernels/quant_matmul/gemv_share.py)."""
    return tiling.arrivals + extra_slots


def reads_x_in_words(
    x2d: torch.Tensor, row_start: int, seg_rows: int, tiling: GemvTiling, *, gather: bool
) -> bool:
    """Whether the GEMV of a segment (rows row_start .. + seg_rows of W) reads x in 8-byte
    words (`_gemv_x_chunk`'s VEC_X): contiguous rows (no gather through perm), whole chunks
    in every split, one group per chunk, and every row of x 8-byte aligned at row_start.
    Otherwise it loads x a row at a time, to the same values."""
    size = x2d.element_size()
    return (
        not gather
        and tiling.grouped
        and seg_rows % (tiling.iters * tiling.block_k) == 0
        and (x2d.data_ptr() + row_start * size) % 8 == 0
        and (x2d.stride(0) * size) % 8 == 0
    )


def launch_gemv_partials(
    x2d: torch.Tensor,
    qw: QuantizedWeight,
    sums: torch.Tensor,
    tiling: GemvTiling,
    *,
    add_bias: bool = True,
    x_in_row_order: bool = False,
) -> None:
    """The GEMV's programs alone: each stores its float32 partial of x2d [M <= 4, k] @ W
    (+ bias, in split 0 of the first segment, unless `add_bias` is False: a slot sum that
    scales the sum adds it after, kernels/quant_matmul/slot_sum.py's SlotNorm) in its own
    slot of sums ([slots, M, n], the first tiling.arrivals slots). One launch per segment.
    `x_in_row_order`: x2d is already x[:, perm] (a slot sum scattered it so, slot_sum.py's
    module docstring): read contiguously, no gather, the same sums."""
    M, n = x2d.shape[0], qw.out_features
    t = tiling
    rows_per_split = t.iters * t.block_k
    gather = qw.perm is not None and not x_in_row_order
    perm = qw.perm if gather else qw.row_group  # dummy pointer when absent
    bias = qw.bias if qw.bias is not None else qw.scales
    segments = [s for s in qw.segments if s.row_end > s.row_start]
    pdl = programmatic_launch(x2d)
    first = True
    slot_base = 0
    for segment in segments:
        seg_rows = segment.row_end - segment.row_start
        vec_x = reads_x_in_words(x2d, segment.row_start, seg_rows, t, gather=gather)
        p0, p1, p0_stride, p1_stride = plane_args(segment)
        grid = (t.n_tiles, triton.cdiv(seg_rows, rows_per_split))
        _gemv_kernel[grid](
            x2d,
            sums,
            p0,
            p1,
            qw.scales,
            qw.zeros,
            qw.row_group,
            perm,
            bias,
            n,
            x2d.stride(0),
            p0_stride,
            p1_stride,
            qw.scales.stride(0),
            segment.row_start,
            seg_rows,
            rows_per_split,
            int(first and add_bias and qw.bias is not None),
            slot_base,
            _FLOAT_MAGIC,
            HAS_PERM=gather,
            GROUPED=t.grouped,
            ZERO_PER_GROUP=per_group_zeros(qw.zeros),
            **plane_meta(segment),
            M_ROWS=M,
            ITERS=t.iters,
            BLOCK_N=t.block_n,
            BLOCK_K=t.block_k,
            PREFETCH=t.prefetch,
            STAGES=1 if gather else t.stages,
            EVEN_K=seg_rows % rows_per_split == 0,
            EVEN_N=n % t.block_n == 0,
            VEC_X=vec_x,
            PTX=x2d.is_cuda,
            USE_PDL=pdl,
            num_warps=t.num_warps,
            launch_pdl=pdl,
        )
        first = False
        slot_base += grid[1]


def launch_gemv_to_slots(
    x2d: torch.Tensor,
    qw: QuantizedWeight,
    tiling: GemvTiling | None = None,
    *,
    add_bias: bool = True,
    x_in_row_order: bool = False,
) -> tuple[torch.Tensor, int]:
    """The first half of every decode GEMV: (the device's workspace, slots) after
    `launch_gemv_partials` stored x2d @ W's partials (+ bias unless not `add_bias`; x2d
    gathered through perm unless `x_in_row_order`) in its first slots; a slot sum
    (kernels/quant_matmul/slot_sum.py, slot_sum_rope.py) finishes."""
    t = tiling if tiling is not None else gemv_tiling(x2d, qw)
    slots = gemv_slots(t)
    sums, _ = split_k_workspace(x2d.device, slots * x2d.shape[0] * qw.out_features, 0)
    launch_gemv_partials(x2d, qw, sums, t, add_bias=add_bias, x_in_row_order=x_in_row_order)
    return sums, slots


def launch_gemv(
    x2d: torch.Tensor,
    qw: QuantizedWeight,
    y: torch.Tensor,
    tiling: GemvTiling | None = None,
    *,
    silu_mul: bool = False,
    norm: SlotNorm | None = None,
    x_in_row_order: bool = False,
    scatter: torch.Tensor | None = None,
) -> None:
    """y [M, n] (x's dtype or float32, contiguous) = x2d [M <= 4, k] @ W (+ bias): the
    GEMV's programs store their partials in the device's workspace slots
    (`launch_gemv_partials`), then the slot sum adds them in slot order into y
    (kernels/quant_matmul/slot_sum.py): the same bits every run. `silu_mul`: W is a fused
    gate_up projection (n = 2I, [gate | up]) and y [M, I] receives silu(gate) * up, the
    bits of the GEMV followed by kernels.silu_mul, from the slot sum. `norm`: x2d is
    h * w (an RMSNorm's input times its weight) and y = rstd * (x2d @ W) + bias, the norm's
    rstd per row applied by the slot sum, which also adds the bias (SlotNorm, issue 28).
    `x_in_row_order`: x2d is x[:, perm] already (no gather); `scatter`: y's column c is
    stored at column scatter[c], the next GEMV's row order (slot_sum.py's docstring).

    If the GPU-side gaps between these launches show in decode profiles, the next step is
    one launch per linear: the split-K axis spanning all segments, with a branch per segment
    (its plane layout as constexprs).
    """
    sums, slots = launch_gemv_to_slots(
        x2d, qw, tiling, add_bias=norm is None, x_in_row_order=x_in_row_order
    )
    bias = qw.bias if norm is not None else None
    launch_slot_sum(sums, y, slots, silu_mul=silu_mul, norm=norm, bias=bias, scatter=scatter)


def launch_gemv_residual(
    x2d: torch.Tensor,
    qw: QuantizedWeight,
    residual: torch.Tensor,
    h: torch.Tensor,
    tiling: GemvTiling | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    unit_offset: bool = False,
    xw: torch.Tensor | None = None,
    xw_scatter: torch.Tensor | None = None,
    x_in_row_order: bool = False,
    config: SlotSumConfig | None = None,
) -> RowSquares:
    """h [M, n] (x's dtype, contiguous) = residual [M, n] + x2d @ W (+ bias), rounded as
    kernels.add_rms_norm rounds its residual output for this GEMV's y, and h's RowSquares;
    with `norm_weight` (the next RMSNorm's, [n]) also xw [M, n] = h * w (or h * (1 + w),
    `unit_offset`) in float32 (exact), the next GEMV's x (`launch_gemv` with a
    SlotNorm): a pre-norm block's o_proj or down_proj with the next norm's add, sum of
    squares and weight in its slot sum (issue 28); `xw_scatter` stores xw in the next GEMV's
    row order, `x_in_row_order` reads x2d in this one's (as `launch_gemv`). `config`: the
    slot sum's (its block is the squares' chunk; tests and benchmarks vary it)."""
    sums, slots = launch_gemv_to_slots(x2d, qw, tiling, x_in_row_order=x_in_row_order)
    return launch_slot_sum_residual(
        sums,
        residual,
        h,
        slots,
        norm_weight=norm_weight,
        unit_offset=unit_offset,
        xw=xw,
        xw_scatter=xw_scatter,
        config=config,
    )
