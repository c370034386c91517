"""The Triton helpers that the quantized matmul kernels share, and that LoRA's expand uses
to add into the decode GEMV's sums: a segment's codes and zero points inside a tile, and
the split-K workspace's arithmetic (`store_partial`, `sum_slots`, `finish_gemv_tile`).

Determinism: split-K partials arrive in whatever order the programs finish. Summed with
float32 atomics, that order could change the last bit of a sum, and rarely a token, from
one run to the next (issue 31). So each program stores its float32 partial into its own
slot of the workspace (slot = its split-K index over all segments' launches; LoRA's
expand, an extra arrival, has a slot after them), and the last program of a tile, found by
the tile's counter, adds the slots in slot order 0, 1, 2, ...: the same float32 operations
every run, for every output dtype, so decode gives the same bits every run and process on
one GPU. Nothing needs zeroing: every slot that is read was written by this call. The
workspace itself (host side) is in kernels/quant_matmul/split_k.py.
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


@triton.jit
def store_partial(sums_ptr, slot, slot_stride, offsets, values, mask):
    """Store one program's float32 partial `values` at `offsets` of its own slot of the
    workspace ([slots, ...] with `slot_stride` elements per slot): a plain store, no atomic.
    Every call writes every slot that its last program reads, so the workspace needs no
    zeroing between calls. Offsets are int32: split_k_workspace keeps the slots below 2^31
    elements."""
    tl.store(sums_ptr + slot * slot_stride + offsets, values, mask=mask)


@triton.jit
def sum_slots(sums_ptr, slot_stride, offsets, mask, SLOTS: tl.constexpr):
    """The float32 sum over slots 0, 1, ..., SLOTS - 1 of the workspace at `offsets`, added
    in that order whatever order the programs finished in: the same bits every run. The
    last program of a tile calls this after every partial has arrived. Read from L2 (.cg),
    past an L1 that may hold the lines from an earlier call. Groups of 8 slots are unrolled
    so that their loads fly together; the adds stay in slot order."""
    total = tl.zeros(offsets.shape, tl.float32)
    for group in range(SLOTS // 8):
        for j in tl.static_range(8):
            slot = group * 8 + j
            total += tl.load(
                sums_ptr + slot * slot_stride + offsets, mask=mask, other=0.0, cache_modifier=".cg"
            )
    for j in tl.static_range(SLOTS % 8):
        slot = (SLOTS // 8) * 8 + j
        total += tl.load(
            sums_ptr + slot * slot_stride + offsets, mask=mask, other=0.0, cache_modifier=".cg"
        )
    return total


@triton.jit
def finish_gemv_tile(
    sums_ptr, y_ptr, counter, arrivals, n, cols, col_ok, M_ROWS: tl.constexpr, SLOTS: tl.constexpr
):
    """The last program of a column tile to finish sums the tile's SLOTS partial slots (in
    slot order, `sum_slots`) and writes them as y; it sets the counter back to 0, so no
    zero-fill or cast kernel runs around the GEMV. The barrier makes every thread's partial
    stores precede the counter's release (the split-K semaphore pattern); the counter's
    acquire orders the last program's loads after every other program's stores."""
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, sem="acq_rel")
    if done == arrivals - 1:
        for m in tl.static_range(M_ROWS):
            sums = sum_slots(sums_ptr, M_ROWS * n, m * n + cols, col_ok, SLOTS)
            tl.store(y_ptr + m * n + cols, sums.to(y_ptr.dtype.element_ty), mask=col_ok)
        tl.store(counter, 0)
