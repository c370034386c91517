"""The host side of what the quantized matmul kernels share (kernels/quant_matmul/gemv.py's
decode GEMV, dot.py's tensor-core path for a few rows of x, dequantize.py): the constexprs
and arguments of a segment's planes, the group check that lets scales apply once per
chunk (`chunks_in_groups`), the split-K plan (`split_iters`), and the per-device workspace
whose slots hold the split-K partials until they are added in a fixed order: by the slot
sum kernel after the decode GEMV (slot_sum.py), by each tile's last program on the mid-M
path (`split_k_workspace`; the kernels' side is kernels/quant_matmul/tiles.py). The design
of the paths is in kernels/quant_matmul/__init__.py's docstring.
"""

from __future__ import annotations

import functools
import weakref

import torch
import triton

from kernels.quant_matmul.layout import QuantizedWeight, Segment

_PLANE_BITS = (1, 2, 4, 8)
# The interpreter has no SMs; a small count keeps CPU tests fast while still splitting K.
_INTERPRETER_SMS = 2


def plane_meta(segment: Segment) -> dict[str, int]:
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


def unit_col_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def plane_args(
    segment: Segment, col_start: int = 0, col_end: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The segment's planes (the second repeats the first when there is one) as views of
    columns [col_start, col_end), and their row strides."""
    # All columns (the decode paths, an unchunked dequantization): no view to build.
    whole = col_start == 0 and col_end in (None, segment.planes[0].packed.shape[1])
    planes = [
        unit_col_stride(plane.packed if whole else plane.packed[:, col_start:col_end])
        for plane in segment.planes
    ]
    second = planes[1] if len(planes) == 2 else planes[0]
    return planes[0], second, planes[0].stride(0), second.stride(0)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's SMs (_INTERPRETER_SMS off CUDA)."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return _cuda_sm_count(device.index if device.index is not None else 0)


def _pow2_floor(value: int) -> int:
    return 1 << (max(value, 1).bit_length() - 1)


def chunk_rows(qw: QuantizedWeight, least: int, most: int) -> int:
    """BLOCK_K: a power of two in [least, most] that divides the typical group size, so
    that chunks lie in one group (see chunks_in_groups). The group size is guessed from
    the shapes (k // G): no device sync."""
    groups = max(qw.scales.shape[0], 1)
    return max(least, min(most, _pow2_floor(qw.in_features // groups)))


# (id of row_group, its data pointer, segment starts, BLOCK_K) -> every chunk in one group.
_GROUPED_CACHE: dict[tuple[int, int, tuple[int, ...], int], bool] = {}


def chunks_in_groups(qw: QuantizedWeight, block_k: int) -> bool:
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


# (id of perm, its data pointer) -> perm's inverse, int32.
_ROW_ORDER_CACHE: dict[tuple[int, int], torch.Tensor] = {}


def row_order(qw: QuantizedWeight) -> torch.Tensor | None:
    """Where each column of x sits in qw's row order: int32 [k], the inverse of perm (the
    decode GEMV's row i reads x[:, perm[i]], so x's column c is its row row_order[c]).
    A slot sum that stores its output at these columns hands the GEMV an x it reads
    without a gather, adding the same products in the same order (kernels/quant_matmul/
    slot_sum.py's docstring). None when qw has no perm, and during CUDA graph capture for
    a weight not seen before (the inverse is computed once per weight and cached; a
    capture's allocations belong to its graph): call once before capturing, as for
    `chunks_in_groups`."""
    perm = qw.perm
    if perm is None:
        return None
    key = (id(perm), perm.data_ptr())
    cached = _ROW_ORDER_CACHE.get(key)
    if cached is not None:
        return cached
    if perm.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    # A normal tensor even under the engine's inference mode (it outlives the call).
    with torch.inference_mode(False):
        inverse = torch.empty_like(perm, dtype=torch.int32)
        inverse[perm.long()] = torch.arange(perm.numel(), dtype=torch.int32, device=perm.device)
    _ROW_ORDER_CACHE[key] = inverse
    weakref.finalize(perm, _ROW_ORDER_CACHE.pop, key, None)
    return inverse


# Per device: a float32 buffer of partial slots and int32 tile counters that are zero
# between calls. A split-K call lays its partials out as [slots, M, n] (kernels/quant_matmul/
# tiles.py: each program stores its own slot, the last program of each tile adds them in
# slot order and sets the tile's counter back to 0), so kernels of one stream share the pair
# in turn and nothing needs zeroing. The first (uncaptured) call of every shape sizes them,
# which a CUDA graph's warm-up run provides. They only grow, and a replaced pair is kept
# alive: a graph captured earlier still writes into it, and freeing it would let the
# allocator hand that memory to another tensor. Growth at least doubles, so the retired
# pairs hold less than the current one.
_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED_WORKSPACES: list[tuple[torch.Tensor, torch.Tensor]] = []


def split_k_workspace(
    device: torch.device, sums: int, tiles: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's workspace: at least `sums` float32 slots' elements (slots * M * n) and
    `tiles` zeroed int32 counters."""
    if sums >= 1 << 31:  # the kernels' slot offsets are int32 (tiles.py: store_partial)
        raise ValueError(f"{sums} split-K partial elements exceed the int32 slot offsets")
    have = _WORKSPACES.get(device)
    if have is None or have[0].numel() < sums or have[1].numel() < tiles:
        old_sums, old_tiles = (have[0].numel(), have[1].numel()) if have else (0, 0)
        if have is not None:
            _RETIRED_WORKSPACES.append(have)
        grow_sums = sums > old_sums
        grow_tiles = tiles > old_tiles
        # Normal tensors even when the first call comes from the engine's inference mode:
        # the workspace outlives that call, and an inference tensor refuses in-place torch
        # ops outside inference mode (tests fill it to check what the kernels write).
        with torch.inference_mode(False):
            have = (
                torch.zeros(
                    min(max(sums, 2 * old_sums if grow_sums else old_sums, 1 << 17), 1 << 31),
                    dtype=torch.float32,
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


def split_iters(
    rows: int, tiles: int, block_k: int, programs_per_sm: int, max_iters: int, device: torch.device
) -> int:
    """Chunks (of block_k rows) per split-K slice: about programs_per_sm programs per SM,
    counted over all segments (each takes ceil(its rows / slice) slices), at most max_iters.

    A power of two: it is a constexpr (see the module docstring), and every distinct value
    is one more compiled kernel per segment layout.
    """
    target = programs_per_sm * sm_count(device)
    splits = max(1, min(triton.cdiv(target, tiles), triton.cdiv(rows, block_k)))
    return min(max_iters, _pow2_floor(triton.cdiv(triton.cdiv(rows, splits), block_k)))
