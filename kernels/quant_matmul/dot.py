"""The mid-M path of the quantized matmul: x [M, k] @ W on the tensor cores for a few rows
of x (batched decode, speculative verification, short prefill chunks), between the decode
GEMV and dequantize + cuBLAS (kernels/quant_matmul/paths.py chooses by M; the package's
docstring describes the design). `launch_dot` runs one launch per segment, split-K, summing
in the shared self-resetting workspace (kernels/quant_matmul/split_k.py) with
`finish_dot_tile`; `DotConfig` and `_DOT_CONFIGS` are its settings per M for weights whose
operand folds zero points and scales (`_fold`: fp16 GPTQ and EXL2), `_UNFOLDED_DOT_CONFIGS`
for the others (tools/tune_mid_m.py sweeps one config at a time).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.backend import cast_rtne, is_interpreted
from kernels.quant_matmul.layout import QuantizedWeight, per_group_zeros
from kernels.quant_matmul.split_k import (
    chunk_rows,
    chunks_in_groups,
    plane_args,
    plane_meta,
    split_iters,
    split_k_workspace,
)
from kernels.quant_matmul.tiles import segment_codes_2d, store_partial, sum_slots, zero_points


@dataclasses.dataclass(frozen=True)
class DotConfig:
    """Launch settings of the mid-M tensor-core path (see `launch_dot`).

    transposed: compute y^T = W^T @ x^T, the dequantized weight tile as the MMA's left
        operand [block_n, BLOCK_K] and x^T as the right one [BLOCK_K, BLOCK_M]. On Hopper
        wgmma reads its left operand from registers, where the codes are unpacked, and
        only the right one from shared memory: x's tile is small. Untransposed, the
        [BLOCK_K, block_n] weight tile is the right operand and goes through shared
        memory every chunk. The output columns are then the MMA's M (64 per warpgroup)
        and the rows of x its N (16 and up), which suits 8-64 rows of x.
    wide: unpack each packed word once and split it by shifts (see _wide_codes)
        rather than gathering the word of every row.
    block_n, min_block_m, max_block_m, max_block_k: the tile; BLOCK_M is the next power
        of two >= M in [min_block_m, max_block_m] (16 is tl.dot's least size), BLOCK_K
        the group-aligned chunk (see chunk_rows).
    max_iters: chunks per split-K slice; programs_per_sm: the split-K target.
    fold: how far the dequantization goes into the operand, for fp16 x, whole-group chunks
        and integer (uint8) zero points, where it stays exact. 0: the MMA takes the raw
        codes and each chunk's product is corrected by x's row sums times the zero points,
        then scaled. 1: the operand is code - zero (the magic-number subtract takes the
        zero along: (1024 + code) - (1024 + zero) is exact in fp16), so no row sums. 2: it
        is (code - zero) * scale in fp16, the same rounding as a dequantized fp16 weight
        (the product of two fp16 values rounds once), so the MMA accumulates across chunks
        with no per-chunk epilogue at all.
    """

    transposed: bool = False
    wide: bool = True
    block_n: int = 128
    min_block_m: int = 16
    max_block_m: int = 64
    max_block_k: int = 64
    max_iters: int = 16
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2
    fold: int = 0


# By the most rows of x each serves, for weights the operand can fold (`_fold`: fp16 x,
# whole-group chunks, uint8 zero points, fp16 scales: GPTQ and EXL2 models in fp16). H100,
# 8B GPTQ, one round of every linear of the model (three sweeps, noise ~5%: mid_fold_* in
# bench/results/2026-11-25-h100-mid-m-fold-and-decode-attention-s8.json):
# folding the zero points and scales into the operand lets the MMAs chain with no per-chunk
# epilogue, and untransposed 16-row tiles then beat the transposed kernel at M <= 16 (3.6-3.7
# ms against 5.2 for the unfolded transposed default); M = 32: 4.5 ms (was 5.1); M = 64:
# 64 x 64 tiles of 128-row chunks, 4.7 ms (was 5.5); M = 128: 8.2 ms with 32 chunks per
# slice (was 9.5; dequantize + cuBLAS takes 13.8). At M = 256 dequantize + cuBLAS wins.
_DOT_CONFIGS: tuple[tuple[int, DotConfig], ...] = (
    (16, DotConfig(block_n=128, min_block_m=16, max_block_m=16, max_block_k=128,
                   programs_per_sm=4, fold=2)),
    (32, DotConfig(block_n=128, min_block_m=32, max_block_m=32, max_block_k=64, fold=2)),
    (64, DotConfig(block_n=64, min_block_m=64, max_block_m=64, max_block_k=128, fold=2)),
    (1 << 62, DotConfig(block_n=128, min_block_m=64, max_block_m=64, max_block_k=64,
                        max_iters=32, fold=2)),
)  # fmt: skip

# Weights or activations the operand cannot fold (bf16 or fp32 x, fractional zero points,
# groups that split a chunk). tools/tune_mid_m.py on an H100 (8B GPTQ, unfolded,
# bench/results/2026-11-25-h100-tune-mid-m.json): at M = 8 the transposed kernel with 64
# columns and 128-row chunks took 5.51 ms per round of linears against 6.54 for the best
# untransposed one; at M = 64 untransposed 128 x 128 took 6.33 against 7.84 for the earlier
# 64-row chunks (and 8.23 transposed). M = 32 with a 32-row tile took 10.8 ms (M = 64: 7.8),
# so rows past 16 take the 64-row tile.
_UNFOLDED_DOT_CONFIGS: tuple[tuple[int, DotConfig], ...] = (
    (16, DotConfig(transposed=True, block_n=64, max_block_k=128)),
    (1 << 62, DotConfig(block_n=128, min_block_m=64, max_block_m=64, max_block_k=128)),
)


@triton.jit
def _codes_to_f32(codes):
    """int32 codes (< 2^23) -> exact float32 without an int-to-float conversion (a
    quarter-rate instruction): OR-ed into the mantissa of 2^23 they read as 2^23 + code."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _dot_f32(a, b, acc, INTERPRETED: tl.constexpr):
    """acc + a @ b with float32 accumulation, for operands of one dtype (fp16, bf16, fp32)."""
    if a.dtype == tl.float32:
        # float32 activations ask for float32 accuracy: tf32x3 (three TF32 products, errors
        # near 2^-22) keeps the tensor cores; an "ieee" dot runs on the FMA units and spills.
        return tl.dot(a, b, acc, input_precision="tf32x3")
    elif INTERPRETED and a.dtype == tl.bfloat16:
        # Triton 3.6's interpreter multiplies bfloat16 operands wrongly; widening is exact.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def finish_dot_tile(
    out_ptr, y_ptr, offsets, mask, counter, arrivals, slot_stride, SLOTS: tl.constexpr
):
    """The last of a tile's `arrivals` programs writes y[offsets] from the sum of its SLOTS
    slots, in slot order, and sets the tile's counter back to 0, so no zero-fill or cast
    kernel runs around the matmul. The barrier makes every thread's partial stores precede
    the counter's release (the split-K semaphore pattern); the counter's acquire orders the
    last program's loads after every other program's stores. (The decode GEMV sums its
    slots in a kernel of its own instead, kernels/quant_matmul/slot_sum.py: there a few
    column tiles' last programs reading every slot alone were on the critical path.)"""
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, sem="acq_rel")
    if done == arrivals - 1:
        sums = sum_slots(out_ptr, slot_stride, offsets, mask, SLOTS, 8)
        tl.store(y_ptr + offsets, sums.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(counter, 0)


@triton.jit
def _codes_to_operand(codes, x_dtype: tl.constexpr):
    """int32 codes (< 256) as the tensor cores' operand in x's dtype, exactly. For fp16
    the code is OR-ed into the mantissa of 1024 as a 16-bit pattern (1024 + code) and 1024
    taken off in fp16: two cheap instructions, against an OR, a float32 subtract and a
    float32-to-fp16 conversion. bf16 has too few mantissa bits for 8-bit codes."""
    if x_dtype == tl.float16:
        return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    else:
        return _codes_to_f32(codes).to(x_dtype)


@triton.jit
def _along_n(v, TRANSPOSED: tl.constexpr):
    """A vector over output columns, broadcast along the accumulator's n axis (axis 1 of
    [M, N]; axis 0 of the transposed [N, M]). A chunk's codes put their columns there too."""
    if TRANSPOSED:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def _along_m(v, TRANSPOSED: tl.constexpr):
    """A vector over rows of x along the accumulator's m axis; a chunk's rows of W (its k
    axis) take the same place in the codes tile ([K, N], or [N, K] transposed)."""
    if TRANSPOSED:
        return v[None, :]
    else:
        return v[:, None]


@triton.jit
def _wide_codes(
    plane_ptr,
    plane_stride,
    r0,
    k_end,
    cols,
    col_ok,
    BITS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """One plane's codes of the chunk of rows [r0, r0 + BLOCK_K) (r0 a multiple of the rows
    per word): [BLOCK_K, BLOCK_N], or [BLOCK_N, BLOCK_K] transposed. Each int32 word is
    loaded once and split into its RPW codes by shifts, then laid out as rows. The
    row-gathering `segment_codes_2d` loads every word RPW times (from L1), which made the
    mid-M path bound by load instructions rather than by the tensor cores or DRAM. Codes of
    rows past k_end are garbage; the caller's x is zero there."""
    RPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = BLOCK_K // RPW
    if TRANSPOSED:
        word = tl.arange(0, W)
        words = tl.load(
            plane_ptr + (r0 // RPW + word)[None, :] * plane_stride + cols[:, None],
            mask=col_ok[:, None] & (r0 + word * RPW < k_end)[None, :],
            other=0,
        )  # [N, W]
        lane = tl.arange(0, RPW)
        codes = (words[:, :, None] >> (lane * BITS)[None, None, :]) & ((1 << BITS) - 1)
        return tl.reshape(codes, (BLOCK_N, BLOCK_K))
    else:
        word = tl.arange(0, W)[:, None, None]  # [W, 1, 1]
        lane = tl.arange(0, RPW)[None, :, None]  # [1, RPW, 1]
        words = tl.load(
            plane_ptr + (r0 // RPW + word) * plane_stride + cols[None, None, :],
            mask=(r0 + word * RPW < k_end) & col_ok[None, None, :],
            other=0,
        )  # [W, 1, N]
        codes = (words >> (lane * BITS)) & ((1 << BITS) - 1)  # [W, RPW, N]
        return tl.reshape(codes, (BLOCK_K, BLOCK_N))


@triton.jit
def _mma(x_tile, w, acc, TRANSPOSED: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + x @ W ([M, N]), or acc + W^T @ x^T ([N, M]) with the weights on the left."""
    if TRANSPOSED:
        return _dot_f32(w, x_tile, acc, INTERPRETED)
    else:
        return _dot_f32(x_tile, w, acc, INTERPRETED)


@triton.jit
def _sum_over_k(x_tile, TRANSPOSED: tl.constexpr):
    if TRANSPOSED:
        return tl.sum(x_tile, axis=0)
    else:
        return tl.sum(x_tile, axis=1)


@triton.jit(do_not_specialize=["add_bias", "arrivals", "slot_base"])
def _dot_kernel(
    x_ptr,  # [M, k], unit column stride
    out_ptr,  # float32 [SLOTS, M, n]: the workspace's partial slots (see finish_dot_tile)
    y_ptr,  # [M, n] in x's dtype, contiguous
    counter_ptr,  # int32 per (row tile, column tile), zero on entry
    arrivals,  # programs per tile over all segments' launches
    slot_base,  # this segment's first slot: the splits of the segments launched before it
    p0_ptr,
    p1_ptr,
    scales_ptr,
    zeros_ptr,
    row_group_ptr,
    perm_ptr,
    bias_ptr,
    M,
    n,
    stride_xm,
    p0_stride,
    p1_stride,
    sz_stride,
    row_start,
    seg_rows,
    rows_per_split,  # ITERS * BLOCK_K
    add_bias,  # 1 for the first segment's launch of a weight with a bias
    HAS_PERM: tl.constexpr,
    GROUPED: tl.constexpr,  # every chunk lies in one group (checked on the host)
    ZERO_PER_GROUP: tl.constexpr,  # zeros hold one zero point per group (per_group_zeros)
    NUM_PLANES: tl.constexpr,
    P0_BITS: tl.constexpr,
    P0_SHIFT: tl.constexpr,
    P1_BITS: tl.constexpr,
    P1_SHIFT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    WIDE: tl.constexpr,  # unpack whole words (BLOCK_K a multiple of every plane's RPW)
    TRANSPOSED: tl.constexpr,  # weights as the MMA's left operand (DotConfig.transposed)
    FOLD: tl.constexpr,  # DotConfig.fold (0 unless GROUPED, fp16 x and uint8 zero points)
    ITERS: tl.constexpr,
    SLOTS: tl.constexpr,  # partial slots per tile (= arrivals), summed in slot order
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] += x [BLOCK_M, BLOCK_K] @ codes [BLOCK_K, BLOCK_N] per chunk,
    or with TRANSPOSED acc [BLOCK_N, BLOCK_M] += codes^T @ x^T; the grid is (row tiles,
    column tiles, splits), or (column tiles, row tiles, splits) transposed."""
    if TRANSPOSED:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        n_tiles = tl.num_programs(0)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        n_tiles = tl.num_programs(1)
    pid_k = tl.program_id(2)
    x_dtype = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + _along_m(offs_m.to(tl.int64) * stride_xm, TRANSPOSED)

    if TRANSPOSED:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    zero_acc = tl.zeros_like(acc)
    k_begin = pid_k * rows_per_split
    k_end = tl.minimum(k_begin + rows_per_split, seg_rows)
    # A constexpr trip count (Triton 3.6's interpreter fails on runtime loop bounds under
    # numpy >= 2.4, triton-lang/triton#9171) and no branch in the body, so that the loads
    # can be software-pipelined. Chunks past k_end (a segment's last split) are masked out.
    for it in range(ITERS):
        r0 = k_begin + it * BLOCK_K
        rows = r0 + offs_k  # [BLOCK_K], segment-relative
        row_ok = rows < k_end
        if WIDE:
            codes = (
                _wide_codes(
                    p0_ptr, p0_stride, r0, k_end, cols, col_ok, P0_BITS, BLOCK_K, BLOCK_N,
                    TRANSPOSED,
                )
                << P0_SHIFT
            )  # fmt: skip
            if NUM_PLANES == 2:
                codes = codes | (
                    _wide_codes(
                        p1_ptr, p1_stride, r0, k_end, cols, col_ok, P1_BITS, BLOCK_K, BLOCK_N,
                        TRANSPOSED,
                    )
                    << P1_SHIFT
                )  # fmt: skip
        else:
            codes = segment_codes_2d(
                p0_ptr,
                p0_stride,
                p1_ptr,
                p1_stride,
                _along_m(rows, TRANSPOSED),
                _along_n(cols, TRANSPOSED),
                _along_m(row_ok, TRANSPOSED) & _along_n(col_ok, TRANSPOSED),
                NUM_PLANES,
                P0_BITS,
                P0_SHIFT,
                P1_BITS,
                P1_SHIFT,
            )
        if HAS_PERM:
            x_cols = tl.load(perm_ptr + row_start + rows, mask=row_ok, other=0)
        else:
            x_cols = row_start + rows
        # Masked rows of x are 0, which cancels whatever the padded codes dequantize to.
        # x's k axis takes the place of the codes' n axis: [M, K], or [K, M] transposed.
        x_tile = tl.load(
            x_rows + _along_n(x_cols, TRANSPOSED),
            mask=_along_m(m_ok, TRANSPOSED) & _along_n(row_ok, TRANSPOSED),
            other=0.0,
        )
        if FOLD > 0:
            group = tl.load(row_group_ptr + row_start + tl.minimum(r0, k_end - 1))
            sz = group * sz_stride + cols
            zero = zero_points(zeros_ptr, group, sz, col_ok, ZERO_PER_GROUP)
            # (1024 + code) - (1024 + zero): both exact in fp16, so is the difference.
            offset = _along_n((zero + 1024.0).to(tl.float16), TRANSPOSED)
            w = (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - offset
            if FOLD == 2:
                scale = tl.load(scales_ptr + sz, mask=col_ok, other=0.0).to(tl.float16)
                acc = _mma(x_tile, w * _along_n(scale, TRANSPOSED), acc, TRANSPOSED, False)
            else:
                scale = tl.load(scales_ptr + sz, mask=col_ok, other=0.0).to(tl.float32)
                part = _mma(x_tile, w, zero_acc, TRANSPOSED, False)
                acc += part * _along_n(scale, TRANSPOSED)
        elif GROUPED:
            # Codes (< 256) are exact in fp16/bf16: the tensor cores see no rounding of W.
            w = _codes_to_operand(codes, x_dtype)
            part = _mma(x_tile, w, zero_acc, TRANSPOSED, EMULATE_BF16)
            group = tl.load(row_group_ptr + row_start + tl.minimum(r0, k_end - 1))
            sz = group * sz_stride + cols
            scale = tl.load(scales_ptr + sz, mask=col_ok, other=0.0).to(tl.float32)
            zero = zero_points(zeros_ptr, group, sz, col_ok, ZERO_PER_GROUP)
            x_sum = _sum_over_k(x_tile.to(tl.float32), TRANSPOSED)
            acc += (part - _along_m(x_sum, TRANSPOSED) * _along_n(zero, TRANSPOSED)) * _along_n(
                scale, TRANSPOSED
            )
        else:
            group = tl.load(row_group_ptr + row_start + rows, mask=row_ok, other=0)
            row_sz = _along_m(group, TRANSPOSED) * sz_stride + _along_n(cols, TRANSPOSED)
            sz_mask = _along_m(row_ok, TRANSPOSED) & _along_n(col_ok, TRANSPOSED)
            row_scale = tl.load(scales_ptr + row_sz, mask=sz_mask, other=0.0)
            row_zero = zero_points(
                zeros_ptr, _along_m(group, TRANSPOSED), row_sz, sz_mask, ZERO_PER_GROUP
            )
            w = (_codes_to_f32(codes) - row_zero) * row_scale.to(tl.float32)
            acc = _mma(x_tile, cast_rtne(w, x_dtype, EMULATE_BF16), acc, TRANSPOSED, EMULATE_BF16)

    bias = tl.load(bias_ptr + cols, mask=col_ok & (pid_k == 0) & (add_bias != 0), other=0.0)
    acc += _along_n(bias.to(tl.float32), TRANSPOSED)
    offsets = _along_m(offs_m.to(tl.int64), TRANSPOSED) * n + _along_n(cols, TRANSPOSED)
    mask = _along_m(m_ok, TRANSPOSED) & _along_n(col_ok, TRANSPOSED)
    slot_stride = M * n
    store_partial(out_ptr, slot_base + pid_k, slot_stride, offsets, acc, mask)
    counter = counter_ptr + pid_m * n_tiles + pid_n
    finish_dot_tile(out_ptr, y_ptr, offsets, mask, counter, arrivals, slot_stride, SLOTS)


def _dot_config(M: int, folded: bool = True) -> DotConfig:
    """The mid-M path's settings for M rows of x (see _DOT_CONFIGS), or for a weight whose
    operand cannot fold (_UNFOLDED_DOT_CONFIGS)."""
    table = _DOT_CONFIGS if folded else _UNFOLDED_DOT_CONFIGS
    return next(config for most, config in table if M <= most)


def _foldable(qw: QuantizedWeight, dtype: torch.dtype) -> bool:
    """fp16 x and integer zero points in [0, 255] (uint8): code - zero is exact in fp16.
    (8-bit GPTQ v1 with a zero point of 256 keeps int16 zeros and the unfolded path.)"""
    return dtype == torch.float16 and qw.zeros.dtype == torch.uint8


def _fold(config: DotConfig, qw: QuantizedWeight, dtype: torch.dtype, grouped: bool) -> int:
    """DotConfig.fold where it applies, else 0: `_foldable`, whole-group chunks and, to
    fold the scale, fp16 scales. Fold 1 is exact; fold 2 rounds W to fp16 once, as
    dequantization does."""
    if not grouped or not _foldable(qw, dtype):
        return 0
    if config.fold == 2 and qw.scales.dtype != torch.float16:
        return 1
    return config.fold


def launch_dot(x2d: torch.Tensor, qw: QuantizedWeight, y: torch.Tensor) -> None:
    """y [M, n] (x's dtype) = x2d @ W (+ bias) on the tensor cores: one launch per segment,
    storing partials in the device's workspace slots like the GEMV, so no zero-fill or
    cast kernel runs around it."""
    M, n, k = x2d.shape[0], qw.out_features, qw.in_features
    config = _dot_config(M, folded=_foldable(qw, x2d.dtype))
    block_k = chunk_rows(qw, 16, config.max_block_k)  # tl.dot's least K
    grouped = chunks_in_groups(qw, block_k)
    fold = _fold(config, qw, x2d.dtype, grouped)
    if fold == 0 and config.fold != 0:  # groups that split the folded table's chunks
        config = _dot_config(M, folded=False)
        block_k = chunk_rows(qw, 16, config.max_block_k)
        grouped = chunks_in_groups(qw, block_k)
        fold = _fold(config, qw, x2d.dtype, grouped)
    block_m = min(config.max_block_m, max(config.min_block_m, triton.next_power_of_2(M)))
    block_n = min(config.block_n, max(16, triton.next_power_of_2(n)))
    m_tiles, n_tiles = triton.cdiv(M, block_m), triton.cdiv(n, block_n)
    iters = split_iters(
        k, m_tiles * n_tiles, block_k, config.programs_per_sm, config.max_iters, x2d.device
    )
    rows_per_split = iters * block_k
    perm = qw.perm if qw.perm is not None else qw.row_group
    bias = qw.bias if qw.bias is not None else qw.scales
    segments = [s for s in qw.segments if s.row_end > s.row_start]
    arrivals = sum(triton.cdiv(s.row_end - s.row_start, rows_per_split) for s in segments)
    workspace, counters = split_k_workspace(x2d.device, arrivals * M * n, m_tiles * n_tiles)
    first = True
    slot_base = 0
    for segment in segments:
        seg_rows = segment.row_end - segment.row_start
        p0, p1, p0_stride, p1_stride = plane_args(segment)
        splits = triton.cdiv(seg_rows, rows_per_split)
        grid = (n_tiles, m_tiles, splits) if config.transposed else (m_tiles, n_tiles, splits)
        _dot_kernel[grid](
            x2d,
            workspace,
            y,
            counters,
            arrivals,
            slot_base,
            p0,
            p1,
            qw.scales,
            qw.zeros,
            qw.row_group,
            perm,
            bias,
            M,
            n,
            x2d.stride(0),
            p0_stride,
            p1_stride,
            qw.scales.stride(0),
            segment.row_start,
            seg_rows,
            rows_per_split,
            int(first and qw.bias is not None),
            HAS_PERM=qw.perm is not None,
            GROUPED=grouped,
            ZERO_PER_GROUP=per_group_zeros(qw.zeros),
            **plane_meta(segment),
            EMULATE_BF16=_INTERPRETED,
            WIDE=config.wide and all(block_k % (32 // p.bits) == 0 for p in segment.planes),
            TRANSPOSED=config.transposed,
            FOLD=fold,
            ITERS=iters,
            SLOTS=arrivals,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        first = False
        slot_base += splits


# Triton 3.6's interpreter truncates float32 -> bfloat16: see kernels.backend.cast_rtne.
_INTERPRETED = is_interpreted(_dot_kernel)
