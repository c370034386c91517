"""The Triton helpers that the quantized matmul kernels share, and that LoRA's expand uses
to add into the decode GEMV's sums: a segment's codes and zero points inside a tile, and
the split-K workspace's arithmetic (`store_partial`, `sum_slots`).

Determinism: split-K partials arrive in whatever order the programs finish. Summed with
float32 atomics, that order could change the last bit of a sum, and rarely a token, from
one run to the next (issue 31). So each program stores its float32 partial into its own
slot of the workspace (slot = its split-K index over all segments' launches; LoRA's
expand has a slot after them), and the slots are added in slot order 0, 1, 2, ...: the
same float32 operations every run, for every output dtype, so decode gives the same bits
every run and process on one GPU. The decode GEMV leaves that sum to a kernel of its own
launched right after it (kernels/quant_matmul/slot_sum.py); the mid-M path's last program
of each tile does it (dot.py's finish_dot_tile). Nothing needs zeroing: every slot that is
read was written by this call. The workspace itself (host side) is in
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


@triton.jit
def store_partial(sums_ptr, slot, slot_stride, offsets, values, mask):
    """Store one program's float32 partial `values` at `offsets` of its own slot of the
    workspace ([slots, ...] with `slot_stride` elements per slot): a plain store, no atomic.
    Every call writes every slot that is read back, so the workspace needs no zeroing
    between calls. Offsets are int32: split_k_workspace keeps the slots below 2^31
    elements."""
    tl.store(sums_ptr + slot * slot_stride + offsets, values, mask=mask)


@triton.jit
def sum_slots(sums_ptr, slot_stride, offsets, mask, SLOTS: tl.constexpr, GROUP: tl.constexpr):
    """The float32 sum over slots 0, 1, ..., SLOTS - 1 of the workspace at `offsets`, added
    in that order whatever order the programs that wrote them finished in: the same bits
    every run. Called once every partial has been stored (kernels/quant_matmul/slot_sum.py,
    dot.py's finish_dot_tile). Read from L2 (.cg), past an L1 that may hold the lines from
    an earlier call. Groups of GROUP slots are unrolled so that their loads fly together
    (GROUP = SLOTS: all of them); the adds stay in slot order."""
    total = tl.zeros(offsets.shape, tl.float32)
    for group in range(SLOTS // GROUP):
        for j in tl.static_range(GROUP):
            slot = group * GROUP + j
            total += tl.load(
                sums_ptr + slot * slot_stride + offsets, mask=mask, other=0.0, cache_modifier=".cg"
            )
    for j in tl.static_range(SLOTS % GROUP):
        slot = (SLOTS // GROUP) * GROUP + j
        total += tl.load(
            sums_ptr + slot * slot_stride + offsets, mask=mask, other=0.0, cache_modifier=".cg"
        )
    return total
