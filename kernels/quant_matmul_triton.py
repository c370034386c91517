"""Quantized matmul y = x @ W + bias over Kestrel's runtime layout, as Triton kernels.

Contract (docs/quant_layout.md is the layout; kernels/quant_matmul.py holds the dataclasses
and the torch references; k = in_features, n = out_features):

    quant_matmul(x [..., k] float16/bfloat16/float32, qw) -> [..., n] in x.dtype
    quant_matmul_triton(x, qw, *, path="auto") -> the same through the kernels
    dequantize_triton(qw, *, dtype=float16, permuted=False) -> W [k, n] in dtype,
        original row order (as dequantize_reference) unless permuted=True

`quant_matmul` runs the kernels on CUDA tensors and `quant_matmul_reference` otherwise
(kernels.backend.resolve_backend); `quant_matmul_triton` forces the kernels and lets tests
and benchmarks pick a path. Every path accumulates in float32 and rounds once to x.dtype.

Paths, by the number of activation rows M (tuning constants below, to be set on the GPU):

* M <= _GEMV_MAX_M (decode): `_gemv_kernel`, a fused dequantizing GEMV. It is bound by
  memory and, nearly as much, by instructions per byte, so each packed int32 word is loaded
  once (coalesced along n, 16 bytes per load) and each code costs about two instructions
  per row of x: a chunk of 32 rows is a [words, rows per word, BLOCK_N] tile held by the
  thread that owns the column (lanes and warps lie only along n, so sums over rows stay in
  registers), and codes are masked in place and used as float32 denormals (see
  `_gemv_plane`). The planes of a segment are separate bit matrices: code = sum of
  plane << shift, so each adds its own dot product. Scale and zero apply once per chunk and
  column: sum_r x_r (c_r s - z) = s * sum_r x_r c_r - z * sum_r x_r, which needs every
  chunk inside one row group. That holds for EXL2 and GPTQ (groups of 32k rows, bit widths
  changing only at group boundaries) and is checked once per weight on the host
  (`_chunks_in_groups`); other groupings take a per-row path. x is gathered through perm
  in the kernel. The grid is (column tiles, split-K slices) with about
  GemvConfig.programs_per_sm programs per SM, so n = k = 4096 still fills 132 SMs. With
  GemvConfig.prefetch each program loads the next chunk's words while it works on this
  one, and the first chunk's before it waits for the previous kernel (programmatic
  dependent launch, kernels/backend.py): weights are never written, so their loads may
  overlap the tail of whatever ran before.
* _GEMV_MAX_M < M < _DEQUANT_MIN_M (batched decode, speculative verification, short
  prefill chunks): `_dot_kernel` (kernels/quant_dot.py), the same split-K structure with
  a [BLOCK_M, BLOCK_K] x tile and a [BLOCK_K, BLOCK_N] code tile on the tensor cores
  (tl.dot, wgmma on Hopper, float32 accumulation, software-pipelined loads). Codes
  (< 256) are exact in fp16/bf16, so the tensor cores see no rounding of W:
  acc += ((x @ codes) - rowsum(x) * z) * s. For fp16 x with uint8 zero points (GPTQ up
  to 8-bit v2, EXL2) the operand is instead (codes - z) * s in fp16 (DotConfig.fold), the
  very W that dequantization writes: the MMAs then chain across chunks with no epilogue.
* M >= _DEQUANT_MIN_M (prefill): `dequantize_triton` writes W in the *original* row order
  (row i lands at perm[i]: whole rows, so no cost), then cuBLAS does x @ W + bias: no
  gathered copy of x. W is a fresh tensor from torch's caching allocator, which hands the
  same block back on the next call of that size (a reusable scratch without a global).

Reduction: split-K partials and the segments are summed with relaxed atomic adds into one
[M, n] buffer (int64 fixed point for float16 outputs, so the sum does not depend on the
order of arrival and decode is bitwise reproducible; float32 otherwise: see
kernels/quant_common.py). One launch per Segment (at most 6; the plane layout is a
compile-time constant of the unpacking code), all adding into the same buffer; the first
one adds the bias. Atomics rather than a second reduction pass: the partials stay in L2
(no [splits, M, n] buffer written and read back) and there is no extra launch. Float32
atomics would let the summation order vary from run to run, flipping the last float32 bit
and, rarely, the rounding to 16 bits; integer sums cannot. The GEMV sums into a per-device
workspace that is zero between calls: the last program of each column tile (an atomic
counter per tile) writes y in x's dtype and zeroes its part again, so a decode linear is
one launch per segment and nothing else (a zero-fill and a cast kernel cost as much as a
small GEMV). The mid-M path sums into the same workspace and finishes its tiles the same
way.

Modules: this one holds the GEMV, the dequantization, the path choice and the public
functions; kernels/quant_dot.py the mid-M tensor-core path (`DotConfig`, `_DOT_CONFIGS`,
`_launch_dot`); kernels/quant_common.py what both read (segment codes, zero points, the
split-K plan, the workspace).

Loops have constexpr trip counts: Triton 3.6's interpreter fails on runtime loop bounds
under numpy >= 2.4 (triton-lang/triton#9171), and the tests run the kernels there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import torch
import triton
import triton.language as tl

from kernels.backend import (
    Backend,
    cast_rtne,
    device_guard,
    is_interpreted,
    pdl_launch_dependents,
    pdl_wait,
    programmatic_launch,
    resolve_backend,
)
from kernels.quant_common import (
    _chunks_in_groups,
    _plane_args,
    _plane_meta,
    _segment_codes_2d,
    _split,
    _unit_col_stride,
    _workspace,
    _zero_points,
    add_partial,
    check_fixed_point_arrivals,
    sums_view,
    take_sums,
)
from kernels.quant_dot import _launch_dot
from kernels.quant_matmul import (
    QuantizedWeight,
    per_group_zeros,
    quant_matmul_reference,
)

Path = Literal["auto", "gemv", "dot", "dequant"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# --- tuning knobs (measured with tools/tune_gemv.py on an H200, 8B shapes; see the docstring) -
# Path thresholds on M, the number of activation rows.
_GEMV_MAX_M = 2
_GEMV_LIMIT_M = 4  # the GEMV unrolls one accumulator per row of x: its hard limit
_DEQUANT_MIN_M = 256
_GEMV_BLOCK_K = 32  # rows per chunk: the least group size of EXL2, one group per chunk


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Launch settings of the decode GEMV (`_GEMV_CONFIG`, read by `_gemv_tiling`).

    num_warps: warps per program; lanes and warps lie only along n, so the sums over rows
        never leave a thread.
    cols_per_thread: by M (index M - 1). Every row of x is loaded (gathered through perm)
        by every thread, so more columns per thread share that cost, until the registers
        run out (M codes * x).
    programs_per_sm: split-K target, counted over all segments: enough resident warps to
        keep the loads in flight, few enough that the float32 atomics (n per split) stay
        cheap next to the weight bytes.
    max_iters: chunks of _GEMV_BLOCK_K rows per program (a loop, not unrolled).
    prefetch: load the next chunk's packed words before working on this one (registers
        as a two-stage pipeline), so a program keeps a load in flight while it computes.
    """

    num_warps: int = 2
    cols_per_thread: tuple[int, int, int, int] = (8, 8, 4, 4)
    programs_per_sm: int = 4
    max_iters: int = 4
    prefetch: bool = False


# tools/tune_gemv.py on an H100 (8B GPTQ shapes, every layer's weight in turn): 4 warps,
# 2 programs per SM was the best single setting (2030 us of GEMV per token against 2058 for
# the earlier 2 warps, 4 per SM). With programmatic dependent launch the prefetch lets the
# first chunk's loads start before the previous kernel has finished: decode graph replay
# 2.76 -> 2.51 ms per token (bench/results/2026-11-25-h100-ab-pdl.json, H100; greedy tokens
# identical).
_GEMV_CONFIG = GemvConfig(
    num_warps=4, cols_per_thread=(8, 8, 4, 4), programs_per_sm=2, max_iters=4, prefetch=True
)
# Dequantization tile (elementwise: stores dominate).
_DEQUANT_BLOCK_K = 32
_DEQUANT_BLOCK_N = 128
_DEQUANT_NUM_WARPS = 4
# The most bytes of dense weight the dequantize + cuBLAS path writes at once. A larger
# linear is dequantized and multiplied in column chunks: a 70B model's fused gate/up would
# take 0.94 GB of fp16 scratch in one piece (and as much again in the prompt graphs' pool),
# in chunks of 8192 x 16384 it takes 256 MiB, and each chunk is still a large matmul. The
# 8B model's linears (at most 235 MB) stay whole.
DEQUANT_SCRATCH_MAX_BYTES = 256 << 20


_FLOAT_MAGIC = 0x4B000000  # the bits of 2^23 as float32


@triton.jit
def _gemv_plane_row(values, row_factor, x_ptrs, row_ok):
    """sum over the chunk's rows of values * x * row_factor, for one row of x -> [N]."""
    xv = tl.load(x_ptrs, mask=row_ok, other=0.0).to(tl.float32) * row_factor  # [W, RPW, 1]
    return tl.sum(tl.sum(values * xv, axis=1), axis=0)


@triton.jit
def _gemv_plane_words(
    plane_ptr, plane_stride, r0, k_end, cols, col_ok, BITS: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The packed words [W, 1, N] of one plane for the chunk of rows [r0, r0 + BLOCK_K):
    r0 is a multiple of 32, hence of the rows per word, so word w of the chunk is word
    r0 / RPW + w. Words past k_end read as 0 (no memory traffic)."""
    RPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = BLOCK_K // RPW
    word = tl.arange(0, W)[:, None, None]  # [W, 1, 1]
    return tl.load(
        plane_ptr + (r0 // RPW + word) * plane_stride + cols[None, None, :],
        mask=(r0 + word * RPW < k_end) & col_ok[None, None, :],
        other=0,
    )


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
    cols3 = cols[None, None, :]
    col_ok3 = col_ok[None, None, :]
    position = lane * BITS
    q = position % 16
    # Codes never straddle bit 16 (BITS divides 16); an arithmetic shift's sign copies land
    # at bit 16 and above, outside every mask.
    code_bits = (words >> (position - q)) & (((1 << BITS) - 1) << q)
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
    part0 = _gemv_plane_row(values, row_factor, x_ptrs, row_ok)
    part1 = part0
    part2 = part0
    part3 = part0
    if M_ROWS > 1:
        part1 = _gemv_plane_row(values, row_factor, x_ptrs + stride_xm, row_ok)
    if M_ROWS > 2:
        part2 = _gemv_plane_row(values, row_factor, x_ptrs + 2 * stride_xm, row_ok)
    if M_ROWS > 3:
        part3 = _gemv_plane_row(values, row_factor, x_ptrs + 3 * stride_xm, row_ok)
    return part0, part1, part2, part3


@triton.jit
def _gemv_zero_term(
    x_ptrs, row_ok, zero, group, group_offsets, zeros_ptr, scales_ptr, cols, col_ok, GROUPED,
    ZERO_PER_GROUP,
):  # fmt: skip
    """What the zeros take off one row of x's dot products: [N]. `zero` (GROUPED) is
    already zero point * scale; otherwise each row's zero point and scale are loaded."""
    xv = tl.load(x_ptrs, mask=row_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
    if GROUPED:
        return tl.sum(xv, axis=0) * zero
    else:
        offsets = group_offsets[:, None] + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        row_zero = _zero_points(zeros_ptr, group[:, None], offsets, mask, ZERO_PER_GROUP)
        row_scale = tl.load(scales_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        return tl.sum(row_zero * row_scale * xv[:, None], axis=0)


@triton.jit(do_not_specialize=["add_bias", "arrivals"])
def _gemv_kernel(
    x_ptr,  # [M, k], unit column stride
    out_ptr,  # [M, n] sums, contiguous, added to atomically (the zeroed workspace: int64
    # fixed point for float16 y, float32 otherwise; see add_partial)
    y_ptr,  # [M, n] in x's dtype, contiguous: written by each column tile's last program
    counter_ptr,  # int32 [column tiles], zero on entry: programs of the tile done so far
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
    arrivals,  # programs per column tile over all segments' launches
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
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels.backend)
):
    pdl_launch_dependents(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # The hint keeps every [.., N] load at 4 elements per thread: the int32 words (16 bytes),
    # and the fp16 scales in the same register layout, so no tile changes layout per chunk.
    cols = tl.max_contiguous(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), 4)
    col_ok = cols < n
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
        next0 = _gemv_plane_words(p0_ptr, p0_stride, k_begin, k_end, cols, col_ok, P0_BITS, BLOCK_K)
        next1 = next0
        if NUM_PLANES == 2:
            next1 = _gemv_plane_words(
                p1_ptr, p1_stride, k_begin, k_end, cols, col_ok, P1_BITS, BLOCK_K
            )
    # Weights are never written by a kernel: their first loads above may fly while the
    # previous kernel finishes; x and the workspace only after it has.
    pdl_wait(USE_PDL)
    for it in range(ITERS):
        r0 = k_begin + it * BLOCK_K
        if PREFETCH:
            # Registers as a two-stage pipeline: this chunk's words were loaded last
            # iteration; the next chunk's loads (masked off past k_end) fly meanwhile.
            words0 = next0
            next0 = _gemv_plane_words(
                p0_ptr, p0_stride, r0 + BLOCK_K, k_end, cols, col_ok, P0_BITS, BLOCK_K
            )
        else:
            words0 = _gemv_plane_words(p0_ptr, p0_stride, r0, k_end, cols, col_ok, P0_BITS, BLOCK_K)
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
        )
        if NUM_PLANES == 2:
            if PREFETCH:
                words1 = next1
                next1 = _gemv_plane_words(
                    p1_ptr, p1_stride, r0 + BLOCK_K, k_end, cols, col_ok, P1_BITS, BLOCK_K
                )
            else:
                words1 = _gemv_plane_words(
                    p1_ptr, p1_stride, r0, k_end, cols, col_ok, P1_BITS, BLOCK_K
                )
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
            )
            a0 += b0
            a1 += b1
            a2 += b2
            a3 += b3

        # Scale and zero: per column once per chunk when the chunk is one group.
        rows = r0 + offs_k
        row_ok = rows < k_end
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
            zero = _zero_points(zeros_ptr, group, sz, col_ok, ZERO_PER_GROUP) * raw_scale
            group_offsets = offs_k  # unused
        else:
            scale = 1.0
            zero = 0.0
            group = tl.load(row_group_ptr + row_start + rows, mask=row_ok, other=0)
            group_offsets = group * sz_stride
        acc0 += a0 * scale - _gemv_zero_term(
            x_ptrs, row_ok, zero, group, group_offsets, zeros_ptr, scales_ptr, cols, col_ok,
            GROUPED, ZERO_PER_GROUP,
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
            )

    # Split 0 of the first segment adds the bias (bias_ptr is a dummy when there is none).
    bias = tl.load(bias_ptr + cols, mask=col_ok & (pid_k == 0) & (add_bias != 0), other=0.0)
    bias = bias.to(tl.float32)
    acc0 += bias
    acc1 += bias
    acc2 += bias
    acc3 += bias
    add_partial(out_ptr, cols, acc0, col_ok)
    if M_ROWS > 1:
        add_partial(out_ptr, n + cols, acc1, col_ok)
    if M_ROWS > 2:
        add_partial(out_ptr, 2 * n + cols, acc2, col_ok)
    if M_ROWS > 3:
        add_partial(out_ptr, 3 * n + cols, acc3, col_ok)
    finish_gemv_tile(out_ptr, y_ptr, counter_ptr + pid_n, arrivals, n, cols, col_ok, M_ROWS)


@triton.jit
def finish_gemv_tile(out_ptr, y_ptr, counter, arrivals, n, cols, col_ok, M_ROWS: tl.constexpr):
    """The last program of a column tile to finish writes the tile's sums as y and leaves
    the workspace as it found it (zeros, counter 0), so no zero-fill or cast kernel runs
    around the GEMV. The barrier makes every thread's atomics precede the counter's
    release (the split-K semaphore pattern); `take_sums` reads them back."""
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, sem="acq_rel")
    if done == arrivals - 1:
        for m in tl.static_range(M_ROWS):
            sums = take_sums(out_ptr, m * n + cols, col_ok)
            tl.store(y_ptr + m * n + cols, sums.to(y_ptr.dtype.element_ty), mask=col_ok)
        tl.store(counter, 0)


@triton.jit
def _dequant_kernel(
    out_ptr,  # [k, n]
    p0_ptr,
    p1_ptr,
    scales_ptr,
    zeros_ptr,
    row_group_ptr,
    perm_ptr,
    n,
    out_stride,
    p0_stride,
    p1_stride,
    sz_stride,
    row_start,
    seg_rows,
    SCATTER: tl.constexpr,  # write permuted row i to its original row perm[i]
    ZERO_PER_GROUP: tl.constexpr,  # zeros hold one zero point per group (per_group_zeros)
    NUM_PLANES: tl.constexpr,
    P0_BITS: tl.constexpr,
    P0_SHIFT: tl.constexpr,
    P1_BITS: tl.constexpr,
    P1_SHIFT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < seg_rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < n)[None, :]
    codes = _segment_codes_2d(
        p0_ptr,
        p0_stride,
        p1_ptr,
        p1_stride,
        rows[:, None],
        cols[None, :],
        mask,
        NUM_PLANES,
        P0_BITS,
        P0_SHIFT,
        P1_BITS,
        P1_SHIFT,
    )
    group = tl.load(row_group_ptr + row_start + rows, mask=row_ok, other=0)
    sz_offsets = group[:, None] * sz_stride + cols[None, :]
    scale = tl.load(scales_ptr + sz_offsets, mask=mask, other=0.0).to(tl.float32)
    zero = _zero_points(zeros_ptr, group[:, None], sz_offsets, mask, ZERO_PER_GROUP)
    # (code - zero) * scale is exact in float32 (9 x 11 significant bits): one rounding at
    # the final cast, like the reference's float32 math.
    w = (codes.to(tl.float32) - zero) * scale
    if SCATTER:
        out_rows = tl.load(perm_ptr + row_start + rows, mask=row_ok, other=0)
    else:
        out_rows = row_start + rows
    out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_ptrs, cast_rtne(w, out_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


# Triton 3.6's interpreter truncates float32 -> bfloat16: see kernels.backend.cast_rtne.
_INTERPRETED = is_interpreted(_dequant_kernel)


# --- host side -------------------------------------------------------------------------------


def _weight_tensors(qw: QuantizedWeight) -> list[torch.Tensor]:
    tensors = [qw.scales, qw.zeros, qw.row_group]
    tensors += [t for t in (qw.perm, qw.bias) if t is not None]
    tensors += [plane.packed for segment in qw.segments for plane in segment.planes]
    return tensors


def _check_args(x: torch.Tensor, qw: QuantizedWeight) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (its last one is k)")
    if x.shape[-1] != qw.in_features:
        raise ValueError(
            f"x's last dimension ({x.shape[-1]}) must equal the weight's in_features "
            f"k={qw.in_features} (out_features n={qw.out_features})"
        )
    weight_devices = {t.device for t in _weight_tensors(qw)}
    if len(weight_devices) > 1:
        names = ", ".join(sorted(str(d) for d in weight_devices))
        raise ValueError(f"the quantized weight's tensors are on several devices: {names}")
    if weight_devices and x.device not in weight_devices:
        raise ValueError(
            f"x is on {x.device} but the quantized weight is on {next(iter(weight_devices))}"
        )
    # The kernels index these with one stride (scales and zeros share theirs, unless zeros
    # hold one zero point per group); a weight that passed QuantizedWeight.validate()
    # always qualifies.
    named = {"scales": qw.scales, "zeros": qw.zeros, "row_group": qw.row_group}
    named.update({"perm": qw.perm, "bias": qw.bias})
    for name, t in named.items():
        if t is not None and not t.is_contiguous() and not (t is qw.zeros and per_group_zeros(t)):
            raise ValueError(
                f"the quantized weight's {name} must be contiguous"
                + (" or one zero point per group (strides (1, 0))" if name == "zeros" else "")
            )


def _gemv_block_n(M: int, n: int, grouped: bool, config: GemvConfig) -> int:
    """BLOCK_N of the GEMV: config.cols_per_thread[M - 1] columns on every lane of every
    warp (2 on the per-row scale path, whose gathered scales fill the registers), or less
    for a narrow n."""
    cols_per_thread = config.cols_per_thread[M - 1] if grouped else 2
    return min(cols_per_thread * 32 * config.num_warps, max(128, triton.next_power_of_2(n)))


@dataclasses.dataclass(frozen=True)
class GemvTiling:
    """How one decode GEMV splits its work: column tiles of block_n, split-K slices of
    iters chunks of block_k rows, and the programs (arrivals) each column tile counts."""

    block_k: int
    block_n: int
    n_tiles: int
    iters: int
    grouped: bool
    arrivals: int
    num_warps: int
    prefetch: bool


def _gemv_tiling(x2d: torch.Tensor, qw: QuantizedWeight) -> GemvTiling:
    M, n, k = x2d.shape[0], qw.out_features, qw.in_features
    config = _GEMV_CONFIG  # one setting for every shape (tools/tune_gemv.py)
    block_k = _GEMV_BLOCK_K
    grouped = _chunks_in_groups(qw, block_k)
    block_n = _gemv_block_n(M, n, grouped, config)
    n_tiles = triton.cdiv(n, block_n)
    iters = _split(k, n_tiles, block_k, config.programs_per_sm, config.max_iters, x2d.device)
    rows_per_split = iters * block_k
    arrivals = sum(
        triton.cdiv(s.row_end - s.row_start, rows_per_split)
        for s in qw.segments
        if s.row_end > s.row_start
    )
    return GemvTiling(
        block_k, block_n, n_tiles, iters, grouped, arrivals, config.num_warps, config.prefetch
    )


@dataclasses.dataclass(frozen=True)
class GemvShare:
    """A decode GEMV that other kernels add into (kernels/lora_matmul.py's expand): they
    atomically add float32 terms to `sums` (row stride n) and arrive at `counters[tile]`
    through `finish_gemv_tile` like one more split-K program, `extra` times per column tile.
    Whichever program arrives last writes the tile of y, so the order of the GEMV and the
    added kernels does not matter: they may run on two streams at once."""

    y: torch.Tensor  # [M, n] in x's dtype
    sums: torch.Tensor  # the device's workspace (int64 fixed point for float16 y), zero
    # between calls
    counters: torch.Tensor  # int32 per column tile, zero between calls
    tiling: GemvTiling
    extra: int

    @property
    def arrivals(self) -> int:
        return self.tiling.arrivals + self.extra


def gemv_share(
    x2d: torch.Tensor, qw: QuantizedWeight, extra_per_tile: Callable[[int], int]
) -> GemvShare | None:
    """Open the decode GEMV of x2d [M, k] @ W to `extra_per_tile(block_n)` added programs per
    column tile, or None when x2d would take another path (M > _GEMV_MAX_M, empty shapes).
    Launch
    it with `launch_gemv_shared`; the added kernels need `tiling.block_n`, `tiling.n_tiles`
    and `arrivals`. The workspace must not be used by another GEMV until both are done."""
    _check_args(x2d, qw)
    M, n = x2d.shape[0], qw.out_features
    if x2d.dim() != 2 or x2d.stride(1) != 1 or M == 0 or n == 0 or _choose_path(M) != "gemv":
        return None
    tiling = _gemv_tiling(x2d, qw)
    workspace, counters = _workspace(x2d.device, M * n, tiling.n_tiles)
    y = torch.empty((M, n), dtype=x2d.dtype, device=x2d.device)
    share = GemvShare(
        y, sums_view(workspace, y.dtype), counters, tiling, extra_per_tile(tiling.block_n)
    )
    check_fixed_point_arrivals(share.arrivals)
    return share


def launch_gemv_shared(x2d: torch.Tensor, qw: QuantizedWeight, share: GemvShare) -> None:
    """The GEMV's own programs of a `gemv_share`; y is complete once the added programs
    have arrived too (stream order or an event join)."""
    with device_guard(x2d):
        _launch_gemv(x2d, qw, share.y, share.tiling, share.extra)


def _launch_gemv(
    x2d: torch.Tensor,
    qw: QuantizedWeight,
    y: torch.Tensor,
    tiling: GemvTiling | None = None,
    extra_arrivals: int = 0,
) -> None:
    """y [M, n] (x's dtype) = x2d [M <= 4, k] @ W (+ bias): one launch per segment, summing
    in the device's self-resetting workspace (see finish_gemv_tile). `extra_arrivals`
    programs of other kernels per column tile add to the same sums (see GemvShare).

    If the GPU-side gaps between these launches show in decode profiles, the next step is
    one launch per linear: the split-K axis spanning all segments, with a branch per segment
    (its plane layout as constexprs).
    """
    M, n = x2d.shape[0], qw.out_features
    t = tiling if tiling is not None else _gemv_tiling(x2d, qw)
    block_k, block_n, n_tiles, iters, grouped = t.block_k, t.block_n, t.n_tiles, t.iters, t.grouped
    rows_per_split = iters * block_k
    perm = qw.perm if qw.perm is not None else qw.row_group  # dummy pointer when absent
    bias = qw.bias if qw.bias is not None else qw.scales
    segments = [s for s in qw.segments if s.row_end > s.row_start]
    arrivals = t.arrivals + extra_arrivals
    workspace, counters = _workspace(x2d.device, M * n, n_tiles)
    out32 = sums_view(workspace, y.dtype)
    check_fixed_point_arrivals(arrivals)
    pdl = programmatic_launch(x2d)
    first = True
    for segment in segments:
        seg_rows = segment.row_end - segment.row_start
        p0, p1, p0_stride, p1_stride = _plane_args(segment)
        grid = (n_tiles, triton.cdiv(seg_rows, rows_per_split))
        _gemv_kernel[grid](
            x2d,
            out32,
            y,
            counters,
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
            int(first and qw.bias is not None),
            arrivals,
            _FLOAT_MAGIC,
            HAS_PERM=qw.perm is not None,
            GROUPED=grouped,
            ZERO_PER_GROUP=per_group_zeros(qw.zeros),
            **_plane_meta(segment),
            M_ROWS=M,
            ITERS=iters,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            PREFETCH=t.prefetch,
            USE_PDL=pdl,
            num_warps=t.num_warps,
            launch_pdl=pdl,
        )
        first = False


def dequantize_triton(
    qw: QuantizedWeight,
    *,
    dtype: torch.dtype = torch.float16,
    permuted: bool = False,
    cols: tuple[int, int] | None = None,
) -> torch.Tensor:
    """W [k, n] in `dtype`: original row order by default (as `dequantize_reference`, so
    y = x @ W + bias), or permuted order (row i is the kernel's row i) with permuted=True.
    `cols` (start, end): only those output columns, W[:, start:end].

    Computed in float32 and rounded once (round to nearest even) to `dtype`.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    k = qw.in_features
    c0, c1 = cols if cols is not None else (0, qw.out_features)
    if not 0 <= c0 <= c1 <= qw.out_features:
        raise ValueError(f"cols {cols} are not a range of the {qw.out_features} columns")
    n = c1 - c0
    out = torch.empty((k, n), dtype=dtype, device=qw.scales.device)
    if k == 0 or n == 0:
        return out
    perm = qw.perm if qw.perm is not None else qw.row_group
    # Column views: the kernel indexes columns from each view's start, with its row stride.
    # Zero points kept one per group (strides (1, 0)) stay the same view.
    scales, zeros = qw.scales[:, c0:c1], qw.zeros[:, c0:c1]
    with device_guard(out):
        for segment in qw.segments:
            seg_rows = segment.row_end - segment.row_start
            if seg_rows <= 0:
                continue
            p0, p1, p0_stride, p1_stride = _plane_args(segment, c0, c1)
            grid = (triton.cdiv(seg_rows, _DEQUANT_BLOCK_K), triton.cdiv(n, _DEQUANT_BLOCK_N))
            _dequant_kernel[grid](
                out,
                p0,
                p1,
                scales,
                zeros,
                qw.row_group,
                perm,
                n,
                out.stride(0),
                p0_stride,
                p1_stride,
                scales.stride(0),
                segment.row_start,
                seg_rows,
                SCATTER=qw.perm is not None and not permuted,
                ZERO_PER_GROUP=per_group_zeros(qw.zeros),
                **_plane_meta(segment),
                EMULATE_BF16=_INTERPRETED,
                BLOCK_K=_DEQUANT_BLOCK_K,
                BLOCK_N=_DEQUANT_BLOCK_N,
                num_warps=_DEQUANT_NUM_WARPS,
            )
    return out


def dequant_chunk_columns(k: int, n: int, itemsize: int) -> int:
    """Columns per dense chunk of the dequantize + cuBLAS path: all n when W [k, n] fits
    DEQUANT_SCRATCH_MAX_BYTES, else the most whole dequantization tiles that do (one at
    least)."""
    if k * n * itemsize <= DEQUANT_SCRATCH_MAX_BYTES:
        return n
    tiles = DEQUANT_SCRATCH_MAX_BYTES // (k * itemsize * _DEQUANT_BLOCK_N)
    return max(tiles, 1) * _DEQUANT_BLOCK_N


def _dequant_matmul(x2d: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x2d @ W + bias through dense W in x's dtype, in column chunks (see
    DEQUANT_SCRATCH_MAX_BYTES). W comes in the original row order: x needs no gather."""
    n = qw.out_features
    step = dequant_chunk_columns(qw.in_features, n, x2d.element_size())
    bias = None if qw.bias is None else qw.bias.to(x2d.dtype)
    if step >= n:
        w = dequantize_triton(qw, dtype=x2d.dtype)
        return x2d @ w if bias is None else torch.addmm(bias, x2d, w)
    out = torch.empty((x2d.shape[0], n), dtype=x2d.dtype, device=x2d.device)
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        w = dequantize_triton(qw, dtype=x2d.dtype, cols=(c0, c1))
        # A column slice of the row-major output is a valid cuBLAS operand (its row
        # stride is n): the product is written in place.
        if bias is None:
            torch.mm(x2d, w, out=out[:, c0:c1])
        else:
            torch.addmm(bias[c0:c1], x2d, w, out=out[:, c0:c1])
        del w  # the next chunk reuses this one's memory
    return out


def _choose_path(M: int) -> Path:
    if M <= _GEMV_MAX_M:
        return "gemv"
    if M < _DEQUANT_MIN_M:
        return "dot"
    return "dequant"


def quant_matmul_triton(
    x: torch.Tensor, qw: QuantizedWeight, *, path: Path = "auto"
) -> torch.Tensor:
    """x [..., k] @ W + bias through the Triton kernels; same contract as
    `quant_matmul_reference`. `path`: "gemv" (M <= _GEMV_LIMIT_M), "dot", "dequant", or
    "auto" to choose by M (see the module docstring).
    """
    _check_args(x, qw)
    if path not in ("auto", "gemv", "dot", "dequant"):
        raise ValueError(f"path must be 'auto', 'gemv', 'dot' or 'dequant', got {path!r}")
    k, n = qw.in_features, qw.out_features
    lead = x.shape[:-1]
    x2d = _unit_col_stride(x.reshape(-1, k))  # [M, k]
    M = x2d.shape[0]
    if path == "auto":
        path = _choose_path(M)
    if M == 0 or n == 0:
        return torch.empty((*lead, n), dtype=x.dtype, device=x.device)

    with device_guard(x):
        if path == "dequant":
            return _dequant_matmul(x2d, qw).reshape(*lead, n)

        if path == "gemv" and M > _GEMV_LIMIT_M:
            raise ValueError(f"path='gemv' takes at most {_GEMV_LIMIT_M} rows of x, got {M}")
        if path == "gemv":
            y = torch.empty((M, n), dtype=x.dtype, device=x.device)
            _launch_gemv(x2d, qw, y)
            return y.reshape(*lead, n)
        y = torch.empty((M, n), dtype=x.dtype, device=x.device)
        _launch_dot(x2d, qw, y)
    return y.reshape(*lead, n)


def quant_matmul(
    x: torch.Tensor, qw: QuantizedWeight, *, backend: Backend = "auto"
) -> torch.Tensor:
    """y [..., n] = x [..., k] @ W + bias in x's dtype; Triton on CUDA, the reference otherwise."""
    _check_args(x, qw)
    if resolve_backend(backend, x, *_weight_tensors(qw)) == "triton":
        return quant_matmul_triton(x, qw)
    return quant_matmul_reference(x, qw)
