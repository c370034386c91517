"""Segmented multi-adapter LoRA: y += sum_s scale[g, s] * (x @ A_s^T) @ B_s^T, in place.

Contract (one linear layer, L adapters stacked for it, S adapter slots in the batch):

    x           [T, K]      activations (float32/float16/bfloat16), rows of G segments
    y           [T, N]      the base layer's output, same dtype as x; updated in place
    a           [L, R, K]   lora_A of each stacked adapter, zero rows past its rank
    b           [L, N, R]   lora_B of each, with the adapter's own alpha/r folded in
    slot_map    [S] int32   slot s -> its index in a/b, or -1 (no LoRA on this layer)
    seg_starts  [G+1] int32 rows seg_starts[g]:seg_starts[g+1] form segment g
    seg_scales  [G, S] f32  each segment's scale per slot; 0 leaves the slot out
    max_seg_len int         host-side bound on a segment's length (sizes the grid)

A segment is the rows of one request (a prefill chunk or one decode token): every row of it
uses the same adapters at the same scales, so a program works on a tile of one segment and
can use tensor-core dots. Several slots may be active in one segment (A + B at 0.5 each);
rows of a segment whose scales are all 0 get nothing added. Math is in float32; the sum of
the adapters' deltas is rounded once into y's dtype.

Prefill chunks (segments of several rows) run one Triton program per (segment, row tile,
column tile) that computes shrink (x @ A^T, [M, R]) and expand (@ B^T) with tensor-core
dots; the shrink is repeated per column tile, which 256-wide tiles keep to a few percent.
Decode steps (one row per segment) run two kernels instead: `lora_shrink` splits x·A^T over
K tiles (one load of A per program, float32 partials), `lora_expand` sums the partials and
adds their product with B. A single decode kernel would have to repeat the whole shrink, 16
to 64 serial K loads, in every column tile; split, each kernel is one wave of loads, and
the shrink can run on a side stream beside the base layer's matmul (engine/lora/layers.py).
`lora_matmul` dispatches: Triton on CUDA tensors, the reference otherwise (see
kernels.backend).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import Backend, cast_rtne, device_guard, is_interpreted, resolve_backend
from kernels.quant_matmul.gemv_share import GemvShare
from kernels.quant_matmul.tiles import store_partial

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_args(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slot_map: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_scales: torch.Tensor,
) -> None:
    if x.dtype not in _DTYPES or y.dtype != x.dtype:
        raise ValueError(f"x and y must share a float dtype, got {x.dtype} and {y.dtype}")
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x [T, K] and y [T, N] expected, got {tuple(x.shape)}, {tuple(y.shape)}")
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
        raise ValueError(
            f"a [L, R, K] and b [L, N, R] expected, got {tuple(a.shape)}, {tuple(b.shape)}"
        )
    if a.shape[2] != x.shape[1] or b.shape[1] != y.shape[1]:
        raise ValueError(
            f"a {tuple(a.shape)} / b {tuple(b.shape)} do not fit "
            f"x {tuple(x.shape)} / y {tuple(y.shape)}"
        )
    if slot_map.dim() != 1 or seg_scales.dim() != 2 or seg_scales.shape[1] != slot_map.shape[0]:
        raise ValueError(
            f"seg_scales [G, S] and slot_map [S] expected, got {tuple(seg_scales.shape)}, "
            f"{tuple(slot_map.shape)}"
        )
    if seg_starts.shape != (seg_scales.shape[0] + 1,):
        raise ValueError(
            f"seg_starts must have G+1 = {seg_scales.shape[0] + 1} entries, "
            f"got {tuple(seg_starts.shape)}"
        )


def lora_matmul_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slot_map: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_scales: torch.Tensor,
    *,
    max_seg_len: int = 0,
) -> torch.Tensor:
    """The contract in plain torch: per active slot, the rows that use it, two matmuls."""
    _check_args(y, x, a, b, slot_map, seg_starts, seg_scales)
    starts = seg_starts.tolist()
    delta: torch.Tensor | None = None
    for s, local in enumerate(slot_map.tolist()):
        if local < 0:
            continue
        rows: list[int] = []
        row_scale: list[float] = []
        for g, scale in enumerate(seg_scales[:, s].tolist()):
            if scale:
                rows.extend(range(starts[g], starts[g + 1]))
                row_scale.extend([scale] * (starts[g + 1] - starts[g]))
        if not rows:
            continue
        index = torch.tensor(rows, device=x.device)
        shrunk = x[index].float() @ a[local].float().t()  # [M, R]
        scale_col = torch.tensor(row_scale, device=x.device)[:, None]
        part = (shrunk * scale_col) @ b[local].float().t()  # [M, N]
        if delta is None:
            delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
        delta[index] += part  # rows are distinct
    if delta is not None:
        y.copy_((y.float() + delta).to(y.dtype))
    return y


@triton.jit
def _lora_kernel(
    x_ptr, y_ptr, a_ptr, b_ptr, slot_map_ptr, seg_starts_ptr, seg_scales_ptr,
    N, K, R, S,
    stride_xm, stride_ym, stride_al, stride_ar, stride_bl, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    tile_m = tl.program_id(1)
    tile_n = tl.program_id(2)
    start = tl.load(seg_starts_ptr + g)
    end = tl.load(seg_starts_ptr + g + 1)
    row0 = start + tile_m * BLOCK_M
    has_rows = row0 < end
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    rank = tl.arange(0, BLOCK_R)
    rank_mask = rank < R
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, S):
        scale = tl.load(seg_scales_ptr + g * S + s)
        local = tl.load(slot_map_ptr + s)
        if has_rows & (scale != 0.0) & (local >= 0):
            shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            a_base = a_ptr + local.to(tl.int64) * stride_al
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_mask = ks < K
                xt = tl.load(
                    x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
                at = tl.load(
                    a_base + rank[None, :] * stride_ar + ks[:, None],
                    mask=k_mask[:, None] & rank_mask[None, :],
                    other=0.0,
                )  # [BLOCK_K, BLOCK_R]: A^T
                if EMULATE_BF16:  # the interpreter cannot dot bfloat16 (numpy has none)
                    shrunk += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
                elif IEEE:
                    shrunk += tl.dot(xt, at, input_precision="ieee")
                else:
                    shrunk += tl.dot(xt, at)
            bt = tl.load(
                b_ptr + local.to(tl.int64) * stride_bl + cols[None, :] * stride_bn + rank[:, None],
                mask=rank_mask[:, None] & col_mask[None, :],
                other=0.0,
            )  # [BLOCK_R, BLOCK_N]: B^T
            shrunk = shrunk * scale
            if EMULATE_BF16:
                rounded = cast_rtne(shrunk, tl.bfloat16, EMULATE_BF16).to(tl.float32)
                acc += tl.dot(rounded, bt.to(tl.float32), input_precision="ieee")
            elif IEEE:
                acc += tl.dot(shrunk, bt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(shrunk.to(bt.dtype), bt)
    if has_rows:
        offs = rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        y = tl.load(y_ptr + offs, mask=mask, other=0.0)
        out = cast_rtne(y.to(tl.float32) + acc, y_ptr.dtype.element_ty, EMULATE_BF16)
        tl.store(y_ptr + offs, out, mask=mask)


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, part_ptr, slot_map_ptr, seg_starts_ptr, seg_scales_ptr,
    K, R, S, SPLITS,
    stride_xm, stride_al, stride_ar,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    # One row per segment (decode). Program (g, split) reduces one K tile of x·A^T for each
    # active slot of segment g into part[g, s, split, :]: every program does one load of A,
    # so the whole shrink is one wave of loads spread over many SMs.
    g = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.load(seg_starts_ptr + g)
    has_row = row < tl.load(seg_starts_ptr + g + 1)
    ks = split * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = ks < K
    rank = tl.arange(0, BLOCK_R)
    rank_mask = rank < R
    if has_row:
        xv = tl.load(x_ptr + row.to(tl.int64) * stride_xm + ks, mask=k_mask, other=0.0)
        xv = xv.to(tl.float32)
        for s in range(0, S):
            scale = tl.load(seg_scales_ptr + g * S + s)
            local = tl.load(slot_map_ptr + s)
            if (scale != 0.0) & (local >= 0):
                a_base = a_ptr + local.to(tl.int64) * stride_al
                at = tl.load(
                    a_base + rank[:, None] * stride_ar + ks[None, :],
                    mask=rank_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )  # [BLOCK_R, BLOCK_K]
                part = tl.sum(at.to(tl.float32) * xv[None, :], axis=1)
                tl.store(part_ptr + ((g * S + s) * SPLITS + split) * BLOCK_R + rank, part)


@triton.jit
def _expand_terms(
    g, has_row, cols, col_ok, rank, rank_mask, splits,
    b_ptr, part_ptr, slot_map_ptr, seg_scales_ptr,
    S, SPLITS, stride_bl, stride_bn,
    BLOCK_R: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    """Row group g's LoRA delta for `cols` ([WIDTH], float32): per active slot, the sum of
    the shrink's partials (a few KB, from L2) times the slot's scale, through B's tile."""
    acc = tl.zeros((WIDTH,), dtype=tl.float32)
    for s in range(0, S):
        scale = tl.load(seg_scales_ptr + g * S + s)
        local = tl.load(slot_map_ptr + s)
        if has_row & (scale != 0.0) & (local >= 0):
            parts = tl.load(
                part_ptr + ((g * S + s) * SPLITS + splits[:, None]) * BLOCK_R + rank[None, :],
                mask=(splits < SPLITS)[:, None],
                other=0.0,
            )  # [BLOCK_SPLITS, BLOCK_R]
            shrunk = tl.sum(parts, axis=0) * scale
            bt = tl.load(
                b_ptr + local.to(tl.int64) * stride_bl + cols[:, None] * stride_bn + rank[None, :],
                mask=col_ok[:, None] & rank_mask[None, :],
                other=0.0,
            )  # [WIDTH, BLOCK_R]
            acc += tl.sum(bt.to(tl.float32) * shrunk[None, :], axis=1)
    return acc


@triton.jit
def _lora_expand_kernel(
    y_ptr, b_ptr, part_ptr, slot_map_ptr, seg_starts_ptr, seg_scales_ptr,
    N, R, S, SPLITS,
    stride_ym, stride_bl, stride_bn,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    # Program (g, column tile): sums the shrink's partials of each active slot (a few KB,
    # from L2), scales them, multiplies by its tile of B and adds the total to y once.
    g = tl.program_id(0)
    tile_n = tl.program_id(1)
    row = tl.load(seg_starts_ptr + g)
    has_row = row < tl.load(seg_starts_ptr + g + 1)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    rank = tl.arange(0, BLOCK_R)
    rank_mask = rank < R
    splits = tl.arange(0, BLOCK_SPLITS)
    acc = _expand_terms(
        g, has_row, cols, col_mask, rank, rank_mask, splits,
        b_ptr, part_ptr, slot_map_ptr, seg_scales_ptr,
        S, SPLITS, stride_bl, stride_bn, BLOCK_R, BLOCK_N,
    )  # fmt: skip
    if has_row:
        offs = row.to(tl.int64) * stride_ym + cols
        y = tl.load(y_ptr + offs, mask=col_mask, other=0.0)
        out = cast_rtne(y.to(tl.float32) + acc, y_ptr.dtype.element_ty, EMULATE_BF16)
        tl.store(y_ptr + offs, out, mask=col_mask)


@triton.jit
def _lora_expand_gemv_kernel(
    sums_ptr, b_ptr, part_ptr, slot_map_ptr, seg_starts_ptr, seg_scales_ptr,
    n, N, R, S, G, SPLITS, extra_slot,
    stride_bl, stride_bn,
    SUB_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
    M_ROWS: tl.constexpr,
):  # fmt: skip
    # The expand into a decode GEMV's partial slots (kernels.quant_matmul.gemv_share.
    # GemvShare): program i stores the LoRA terms of SUB_N columns in the workspace's slot
    # `extra_slot` (kernels.quant_matmul.tiles.store_partial); the slot sum after the GEMV
    # adds that slot after the GEMV's own. No read-modify-write of y, no ordering against
    # the GEMV, and one rounding of base + delta.
    cols = tl.program_id(0) * SUB_N + tl.arange(0, SUB_N)
    col_ok = cols < N
    rank = tl.arange(0, BLOCK_R)
    rank_mask = rank < R
    splits = tl.arange(0, BLOCK_SPLITS)
    slot_stride = M_ROWS * n
    # The slot is not zeroed between calls: every row of these columns below n is written,
    # as 0 where no segment adds (rows without one, columns of y past b's N). The barrier
    # orders these stores before the terms' stores to the same addresses, which threads of
    # another layout may hold.
    for m in tl.static_range(M_ROWS):
        zeros = tl.zeros([SUB_N], tl.float32)
        store_partial(sums_ptr, extra_slot, slot_stride, m * n + cols, zeros, cols < n)
    tl.debug_barrier()
    for g in range(0, G):
        row = tl.load(seg_starts_ptr + g)
        has_row = row < tl.load(seg_starts_ptr + g + 1)
        acc = _expand_terms(
            g, has_row, cols, col_ok, rank, rank_mask, splits,
            b_ptr, part_ptr, slot_map_ptr, seg_scales_ptr,
            S, SPLITS, stride_bl, stride_bn, BLOCK_R, SUB_N,
        )  # fmt: skip
        if has_row:
            store_partial(sums_ptr, extra_slot, slot_stride, row * n + cols, acc, col_ok)


# Elements of one program's tile of A ([R, K]) in the shrink, and of B ([N, R]) in the
# expand: small enough for registers, and small enough that even a 4096-wide projection
# spreads its shrink over 16+ programs (latency, not bytes, bounds these kernels).
SHRINK_TILE = 4096
EXPAND_TILE = 4096


def _rank_block(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def _shrink_block_k(k: int, rank: int) -> int:
    return min(max(16, SHRINK_TILE // _rank_block(rank)), max(16, triton.next_power_of_2(k)))


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    slot_map: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_scales: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """First half of a decode step's LoRA (one row per segment): the per-K-tile partial sums
    of x·A^T of every active (segment, slot), float32 [G, S, splits, R_block]. Entries of
    inactive slots are left unwritten; `lora_expand` never reads them. `out` (from
    `lora_partials_shape`) lets a caller allocate it on another stream than the kernel's."""
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(
            f"x [T, K] and a [L, R, K] expected, got {tuple(x.shape)}, {tuple(a.shape)}"
        )
    if x.stride(1) != 1 or not a.is_contiguous():
        raise ValueError("x needs contiguous rows and a must be contiguous")
    shape = lora_partials_shape(x.shape[1], a.shape[1], seg_scales.shape[0], seg_scales.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=x.device)
    elif tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {shape}")
    groups, slots, splits, block_r = shape
    if groups == 0 or slots == 0:
        return out
    k, rank = x.shape[1], a.shape[1]
    with device_guard(x):
        _lora_shrink_kernel[(groups, splits)](
            x, a, out, slot_map.to(torch.int32), seg_starts.to(torch.int32),
            seg_scales.to(torch.float32),
            k, rank, slots, splits,
            x.stride(0), a.stride(0), a.stride(1),
            BLOCK_K=_shrink_block_k(k, rank), BLOCK_R=block_r,
        )  # fmt: skip
    return out


def lora_partials_shape(k: int, rank: int, groups: int, slots: int) -> tuple[int, int, int, int]:
    """Shape of `lora_shrink`'s output for inputs of width k, stacks of rank `rank`, G
    segments and S slots."""
    return (groups, slots, triton.cdiv(k, _shrink_block_k(k, rank)), _rank_block(rank))


def _expand_sub_n(n: int, rank: int) -> int:
    return min(triton.next_power_of_2(n), max(16, EXPAND_TILE // _rank_block(rank)))


def lora_expand_into_gemv(
    share: GemvShare,
    partials: torch.Tensor,
    b: torch.Tensor,
    slot_map: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_scales: torch.Tensor,
) -> None:
    """The expand of `lora_expand`, stored into a decode GEMV's extra partial slot instead
    of added to y (see GemvShare): y = round(x @ W + bias + delta) once the GEMV and this
    have both run, in either order, and `finish_gemv_shared` has summed the slots. b
    [L, N, R] may cover fewer columns than the GEMV (padded quantized outputs)."""
    if not b.is_contiguous() or b.dim() != 3 or partials.dim() != 4:
        raise ValueError("b must be a contiguous [L, N, R] stack and partials [G, S, splits, R]")
    groups, slots, splits, block_r = partials.shape
    m, n = share.rows, share.n
    if b.shape[1] > n or seg_starts.shape != (groups + 1,):
        raise ValueError(
            f"b {tuple(b.shape)} / seg_starts {tuple(seg_starts.shape)} do not fit "
            f"the GEMV's {m} x {n} output"
        )
    sub_n = _expand_sub_n(n, b.shape[2])
    with device_guard(share.y):
        _lora_expand_gemv_kernel[(triton.cdiv(n, sub_n),)](
            share.sums, b, partials,
            slot_map.to(torch.int32), seg_starts.to(torch.int32), seg_scales.to(torch.float32),
            n, b.shape[1], b.shape[2], slots, groups, splits, share.extra_slot,
            b.stride(0), b.stride(1),
            SUB_N=sub_n, BLOCK_R=block_r, BLOCK_SPLITS=triton.next_power_of_2(max(splits, 1)),
            M_ROWS=m,
        )  # fmt: skip


def lora_expand(
    y: torch.Tensor,
    partials: torch.Tensor,
    b: torch.Tensor,
    slot_map: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_scales: torch.Tensor,
) -> torch.Tensor:
    """Second half: y[row of g] += sum over active slots s of scale[g, s] * shrink · B_s^T,
    in place (one rounding into y's dtype); returns y."""
    if y.stride(1) != 1 or not b.is_contiguous():
        raise ValueError("y needs contiguous rows and b must be contiguous")
    if b.dim() != 3 or b.shape[1] != y.shape[1] or partials.dim() != 4:
        raise ValueError(
            f"y [T, N], b [L, N, R] and partials [G, S, splits, R] expected, got "
            f"{tuple(y.shape)}, {tuple(b.shape)}, {tuple(partials.shape)}"
        )
    groups, slots, splits, block_r = partials.shape
    if groups == 0 or slots == 0:
        return y
    n, rank = y.shape[1], b.shape[2]
    block_n = min(256, max(16, EXPAND_TILE // block_r))
    emulate_bf16 = _INTERPRETED and y.dtype == torch.bfloat16
    with device_guard(y):
        _lora_expand_kernel[(groups, triton.cdiv(n, block_n))](
            y, b, partials, slot_map.to(torch.int32), seg_starts.to(torch.int32),
            seg_scales.to(torch.float32),
            n, rank, slots, splits,
            y.stride(0), b.stride(0), b.stride(1),
            BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_SPLITS=triton.next_power_of_2(splits),
            EMULATE_BF16=emulate_bf16,
        )  # fmt: skip
    return y


_INTERPRETED = is_interpreted(_lora_kernel)


def lora_matmul_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slot_map: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_scales: torch.Tensor,
    *,
    max_seg_len: int,
) -> torch.Tensor:
    _check_args(y, x, a, b, slot_map, seg_starts, seg_scales)
    if x.stride(1) != 1 or y.stride(1) != 1 or not a.is_contiguous() or not b.is_contiguous():
        raise ValueError("x and y need contiguous rows, a and b must be contiguous")
    groups, slots = seg_scales.shape
    n, k = y.shape[1], x.shape[1]
    rank = a.shape[1]
    if groups == 0 or slots == 0 or x.shape[0] == 0 or max_seg_len <= 0:
        return y
    block_r = max(16, triton.next_power_of_2(rank))
    emulate_bf16 = _INTERPRETED and x.dtype == torch.bfloat16
    args = (
        x, y, a, b,
        slot_map.to(torch.int32), seg_starts.to(torch.int32), seg_scales.to(torch.float32),
        n, k, rank, slots,
        x.stride(0), y.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
    )  # fmt: skip
    if max_seg_len == 1:
        partials = lora_shrink(x, a, slot_map, seg_starts, seg_scales)
        return lora_expand(y, partials, b, slot_map, seg_starts, seg_scales)
    long = max_seg_len > 16
    block_m = 64 if long else 16
    # Every column tile repeats the shrink of its rows: at prefill, 256-wide tiles keep
    # that repetition to R / 256 of the base matmul's FLOPs (6% at R = 16).
    block_n = 256 if long else 128
    grid = (groups, triton.cdiv(max_seg_len, block_m), triton.cdiv(n, block_n))
    with device_guard(x):
        _lora_kernel[grid](
            *args, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, BLOCK_R=block_r,
            IEEE=x.dtype == torch.float32, EMULATE_BF16=emulate_bf16,
            num_warps=8 if long else 4,
        )  # fmt: skip
    return y


def lora_matmul(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slot_map: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_scales: torch.Tensor,
    *,
    max_seg_len: int,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Add the segments' LoRA deltas to y in place and return y (see the module docstring)."""
    path = resolve_backend(backend, y, x, a, b)
    fn = lora_matmul_triton if path == "triton" else lora_matmul_reference
    return fn(y, x, a, b, slot_map, seg_starts, seg_scales, max_seg_len=max_seg_len)
