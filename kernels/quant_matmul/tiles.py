"""The Triton helpers that the quantized matmul kernels share, and that LoRA's expand uses
to add into the decode GEMV's sums: a segment's codes and zero points inside a tile, and
the split-K workspace's arithmetic (`add_partial`, `take_sums`, `finish_gemv_tile`).

Determinism: split-K partials arrive in whatever order the programs finish. Summed as
float32 atomics (the default: the fastest), that order can change the last bit of a sum,
and rarely a token, from one run to the next. With `kernels.backend.set_deterministic_sums`
(EngineOptions.deterministic) float16 outputs sum as 64-bit fixed point instead
(`FIXED_POINT_SCALE`): integer addition does not depend on order, so decode gives the same
bits every run, for 12% of batch-1 decode speed (H100, 8B GPTQ: 64-bit atomics cost more).
bfloat16 and float32 outputs need more range than 64 bits of fixed point give at their
precision, and keep float32 atomics either way. The workspace itself (host side) is in
kernels/quant_matmul/split_k.py.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _unpack_rows(plane_ptr, plane_stride, word_rows, shifts, cols, mask, BITS: tl.constexpr):
    """Codes of one plane: word_rows selects the int32 row, shifts the bit offset in it."""
    words = tl.load(plane_ptr + word_rows * plane_stride + cols, mask=mask, other=0)
    # Arithmetic shift: the mask drops the sign bits an 8-bit top code drags in.
    return (words >> shifts) & ((1 << BITS) - 1)


@triton.jit
def segment_codes_2d(
    p0_ptr,
    p0_stride,
    p1_ptr,
    p1_stride,
    rows,
    cols,
    mask,
    NUM_PLANES: tl.constexpr,
    P0_BITS: tl.constexpr,
    P0_SHIFT: tl.constexpr,
    P1_BITS: tl.constexpr,
    P1_SHIFT: tl.constexpr,
):
    """Codes [K, N] of segment-relative rows [K, 1] and columns [1, N].

    The word of each row is gathered separately (rows of one word hit L1): the tile goes to
    tl.dot or to memory in this 2-D layout, and its cost is shared by BLOCK_M rows of x.
    """
    RPW0: tl.constexpr = 32 // P0_BITS
    codes = _unpack_rows(
        p0_ptr, p0_stride, rows // RPW0, (rows % RPW0) * P0_BITS, cols, mask, P0_BITS
    )
    codes = codes << P0_SHIFT
    if NUM_PLANES == 2:
        RPW1: tl.constexpr = 32 // P1_BITS
        codes1 = _unpack_rows(
            p1_ptr, p1_stride, rows // RPW1, (rows % RPW1) * P1_BITS, cols, mask, P1_BITS
        )
        codes = codes | (codes1 << P1_SHIFT)
    return codes


@triton.jit
def zero_points(zeros_ptr, group, offsets, mask, ZERO_PER_GROUP):
    """Zero points in float32 at `offsets` (group * stride + column), or one per group,
    zeros[group] broadcast to the shape of `offsets` (kernels.quant_matmul.per_group_zeros:
    G bytes to read instead of G * n)."""
    if ZERO_PER_GROUP:
        return tl.load(zeros_ptr + group).to(tl.float32) + tl.zeros(offsets.shape, tl.float32)
    else:
        return tl.load(zeros_ptr + offsets, mask=mask, other=0.0).to(tl.float32)


# Fixed-point sums (float16 outputs): a partial p adds round(p * 2^32) to an int64. A
# partial is clamped to +-2^20 first (16 times float16's largest value, so a clamped sum
# still overflows to inf when cast to float16), and at most MAX_FIXED_POINT_ARRIVALS
# partials meet in one sum: 1024 * 2^52 = 2^62, no overflow. The grid (2^-32) is far
# below float16's smallest step (2^-24), so the sum rounds to float16 as a float32 sum would.
FIXED_POINT_SCALE = 2.0**32
FIXED_POINT_LIMIT = 2.0**20
MAX_FIXED_POINT_ARRIVALS = 1024


@triton.jit
def add_partial(sums_ptr, offsets, values, mask):
    """Atomically add float32 `values` to the workspace at `offsets`: as fixed point when
    the workspace is int64 (float16 outputs: the sum does not depend on the order of
    arrival), else as float32. A NaN partial adds as the limit (the float16 sum is inf)."""
    if sums_ptr.dtype.element_ty == tl.int64:
        clean = tl.where(values != values, 2.0**20, values)  # FIXED_POINT_LIMIT
        clean = tl.minimum(tl.maximum(clean, -(2.0**20)), 2.0**20)
        scaled = clean * 4294967296.0  # FIXED_POINT_SCALE; |scaled| <= 2^52, exact
        fixed = (scaled + tl.where(scaled < 0, -0.5, 0.5)).to(tl.int64)  # nearest
        tl.atomic_add(sums_ptr + offsets, fixed, mask=mask, sem="relaxed")
    else:
        tl.atomic_add(sums_ptr + offsets, values, mask=mask, sem="relaxed")


@triton.jit
def take_sums(sums_ptr, offsets, mask):
    """The workspace's sums at `offsets` as float32, zeroed again behind them (the last
    program of a tile calls this after every partial has arrived). Read from L2 (.cg),
    past an L1 that may hold the lines from an earlier call."""
    sums = tl.load(sums_ptr + offsets, mask=mask, other=0, cache_modifier=".cg")
    # Every thread has read before any zeroes: a layout may hold an element in several
    # threads (an MMA accumulator tile narrower than a warpgroup's 64 rows).
    tl.debug_barrier()
    tl.store(sums_ptr + offsets, tl.zeros_like(sums), mask=mask)
    if sums_ptr.dtype.element_ty == tl.int64:
        return sums.to(tl.float32) * (1.0 / 4294967296.0)
    else:
        return sums


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
