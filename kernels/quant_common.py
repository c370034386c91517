"""What the quantized matmul kernels share: kernels/quant_matmul_triton.py's decode GEMV and
dequantization, and kernels/quant_dot.py's tensor-core path for a few rows of x.

Inside a kernel: a segment's codes gathered row by row (`_segment_codes_2d`) and its zero
points (`_zero_points`). On the host: the constexprs and arguments of a segment's planes,
the group check that lets scales apply once per chunk (`_chunks_in_groups`), the split-K
plan (`_split`), and the per-device workspace that split-K partials sum into and that the
last program of each tile leaves zeroed again (`_workspace`, `add_partial`,
`take_sums`). The design of the paths is in kernels/quant_matmul_triton.py's docstring.

Determinism: split-K partials arrive in whatever order the programs finish. Summed as
float32 atomics (the default: the fastest), that order can change the last bit of a sum,
and rarely a token, from one run to the next. With `kernels.backend.set_deterministic_sums`
(EngineOptions.deterministic) float16 outputs sum as 64-bit fixed point instead
(`FIXED_POINT_SCALE`): integer addition does not depend on order, so decode gives the same
bits every run, for 12% of batch-1 decode speed (H100, 8B GPTQ: 64-bit atomics cost more).
bfloat16 and float32 outputs need more range than 64 bits of fixed point give at their
precision, and keep float32 atomics either way.
"""

from __future__ import annotations

import functools
import weakref

import torch
import triton
import triton.language as tl

from kernels.backend import deterministic_sums
from kernels.quant_matmul import QuantizedWeight, Segment

_PLANE_BITS = (1, 2, 4, 8)
# The interpreter has no SMs; a small count keeps CPU tests fast while still splitting K.
_INTERPRETER_SMS = 2


@triton.jit
def _unpack_rows(plane_ptr, plane_stride, word_rows, shifts, cols, mask, BITS: tl.constexpr):
    """Codes of one plane: word_rows selects the int32 row, shifts the bit offset in it."""
    words = tl.load(plane_ptr + word_rows * plane_stride + cols, mask=mask, other=0)
    # Arithmetic shift: the mask drops the sign bits an 8-bit top code drags in.
    return (words >> shifts) & ((1 << BITS) - 1)


@triton.jit
def _segment_codes_2d(
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
def _zero_points(zeros_ptr, group, offsets, mask, ZERO_PER_GROUP):
    """Zero points in float32 at `offsets` (group * stride + column), or one per group,
    zeros[group] broadcast to the shape of `offsets` (kernels.quant_matmul.per_group_zeros:
    G bytes to read instead of G * n)."""
    if ZERO_PER_GROUP:
        return tl.load(zeros_ptr + group).to(tl.float32) + tl.zeros(offsets.shape, tl.float32)
    else:
        return tl.load(zeros_ptr + offsets, mask=mask, other=0.0).to(tl.float32)


def _plane_meta(segment: Segment) -> dict[str, int]:
    """The constexprs describing a segment's planes (at most 2: widths 3, 5 and 6 use 2)."""
    planes = segment.planes
    if not 1 <= len(planes) <= 2:
        raise ValueError(f"a segment must have 1 or 2 planes, got {len(planes)}")
    for plane in planes:
        if plane.bits not in _PLANE_BITS:
            raise ValueError(f"plane bits must be one of {_PLANE_BITS}, got {plane.bits}")
        if plane.packed.dtype != torch.int32:
            raise ValueError(f"packed planes must be int32, got {plane.packed.dtype}")
    second = planes[1] if len(planes) == 2 else planes[0]
    return {
        "NUM_PLANES": len(planes),
        "P0_BITS": planes[0].bits,
        "P0_SHIFT": planes[0].shift,
        "P1_BITS": second.bits,
        "P1_SHIFT": second.shift,
    }


def _unit_col_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _plane_args(
    segment: Segment, col_start: int = 0, col_end: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The segment's planes (the second repeats the first when there is one) as views of
    columns [col_start, col_end), and their row strides."""
    # All columns (the decode paths, an unchunked dequantization): no view to build.
    whole = col_start == 0 and col_end in (None, segment.planes[0].packed.shape[1])
    planes = [
        _unit_col_stride(plane.packed if whole else plane.packed[:, col_start:col_end])
        for plane in segment.planes
    ]
    second = planes[1] if len(planes) == 2 else planes[0]
    return planes[0], second, planes[0].stride(0), second.stride(0)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return _cuda_sm_count(device.index if device.index is not None else 0)


def _pow2_floor(value: int) -> int:
    return 1 << (max(value, 1).bit_length() - 1)


def _chunk_rows(qw: QuantizedWeight, least: int, most: int) -> int:
    """BLOCK_K: a power of two in [least, most] that divides the typical group size, so
    that chunks lie in one group (see _chunks_in_groups). The group size is guessed from
    the shapes (k // G): no device sync."""
    groups = max(qw.scales.shape[0], 1)
    return max(least, min(most, _pow2_floor(qw.in_features // groups)))


# (id of row_group, its data pointer, segment starts, BLOCK_K) -> every chunk in one group.
_GROUPED_CACHE: dict[tuple[int, int, tuple[int, ...], int], bool] = {}


def _chunks_in_groups(qw: QuantizedWeight, block_k: int) -> bool:
    """Whether every chunk of block_k rows (from each segment's start) lies in one group.

    Then the kernels load scales and zeros once per chunk and column (GROUPED); otherwise
    per row. True for EXL2 and GPTQ whenever block_k divides the group size, since their
    bit widths change only at group boundaries. Computed once per weight (one device sync)
    and cached; during CUDA graph capture, where a sync is not allowed, an uncached weight
    takes the per-row path (correct, slower): call the op once before capturing.
    """
    starts = tuple(segment.row_start for segment in qw.segments)
    row_group = qw.row_group
    key = (id(row_group), row_group.data_ptr(), starts, block_k)
    cached = _GROUPED_CACHE.get(key)
    if cached is not None:
        return cached
    if row_group.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    firsts, lasts = [], []
    for segment in qw.segments:
        for first in range(segment.row_start, segment.row_end, block_k):
            firsts.append(first)
            lasts.append(min(first + block_k, segment.row_end) - 1)
    index = torch.tensor(firsts + lasts, dtype=torch.long).to(row_group.device)
    groups = row_group[index].view(2, -1)
    result = bool((groups[0] == groups[1]).all())
    _GROUPED_CACHE[key] = result
    weakref.finalize(row_group, _GROUPED_CACHE.pop, key, None)
    return result


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


def sums_view(workspace: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The workspace as the kernels sum into it for outputs of `out_dtype`: int64 fixed
    point for float16 under `deterministic_sums()`, the same zeroed bytes as float32
    otherwise (the kernels pick the arithmetic from the pointer's type)."""
    if out_dtype == torch.float16 and deterministic_sums():
        return workspace
    return workspace.view(torch.float32)


def check_fixed_point_arrivals(arrivals: int) -> None:
    """The fixed-point sums have room for MAX_FIXED_POINT_ARRIVALS partials each."""
    if arrivals > MAX_FIXED_POINT_ARRIVALS:
        raise ValueError(
            f"{arrivals} split-K partials per output exceed the fixed-point workspace's "
            f"{MAX_FIXED_POINT_ARRIVALS} (in_features too large for the decode kernels)"
        )


# Per device: an int64 sum buffer (viewed as float32 for bfloat16/float32 outputs) and
# int32 tile counters that are zero between calls.
# Each GEMV and mid-M matmul leaves them zeroed (the last program per tile resets its
# part), so kernels of one stream share them in turn. The first (uncaptured) call of every
# shape sizes them, which a CUDA graph's warm-up run provides. They only grow, and a
# replaced pair is kept alive: a graph captured earlier still adds into it, and freeing it
# would let the allocator hand that memory to another tensor. Growth at least doubles, so
# the retired pairs hold less than the current one.
_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED_WORKSPACES: list[tuple[torch.Tensor, torch.Tensor]] = []


def _workspace(device: torch.device, sums: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    have = _WORKSPACES.get(device)
    if have is None or have[0].numel() < sums or have[1].numel() < tiles:
        old_sums, old_tiles = (have[0].numel(), have[1].numel()) if have else (0, 0)
        if have is not None:
            _RETIRED_WORKSPACES.append(have)
        grow_sums = sums > old_sums
        grow_tiles = tiles > old_tiles
        have = (
            torch.zeros(
                max(sums, 2 * old_sums if grow_sums else old_sums, 1 << 16),
                dtype=torch.int64,
                device=device,
            ),
            torch.zeros(
                max(tiles, 2 * old_tiles if grow_tiles else old_tiles, 1024),
                dtype=torch.int32,
                device=device,
            ),
        )
        _WORKSPACES[device] = have
    return have


def _split(
    rows: int, tiles: int, block_k: int, programs_per_sm: int, max_iters: int, device: torch.device
) -> int:
    """Chunks (of block_k rows) per split-K slice: about programs_per_sm programs per SM,
    counted over all segments (each takes ceil(its rows / slice) slices), at most max_iters.

    A power of two: it is a constexpr (see the module docstring), and every distinct value
    is one more compiled kernel per segment layout.
    """
    target = programs_per_sm * _sm_count(device)
    splits = max(1, min(triton.cdiv(target, tiles), triton.cdiv(rows, block_k)))
    return min(max_iters, _pow2_floor(triton.cdiv(triton.cdiv(rows, splits), block_k)))
