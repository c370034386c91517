"""The second half of the decode GEMV's split-K reduction: y = the sum of the workspace's
partial slots, in slot order, by a kernel of its own launched right after the GEMV
(`launch_slot_sum`).

Why a kernel of its own (issue 31): fixed-order sums make decode bitwise reproducible, but
when each column tile's last GEMV program summed its tile's slots, a few programs (4 column
tiles of 1024 columns for a 4096-wide output, 32-112 slots each) read every partial alone,
serially, at the end of the GEMV: 15% of 8B decode. Here many small programs (a few dozen
to a few hundred columns each, every slot's load in flight at once) share that read, and
with programmatic dependent launch (kernels/backend.py) this kernel is already resident
when the GEMV's last program ends: it waits for the GEMV's writes, reads them from L2 and
writes y. The GEMV itself needs no atomics, no counters and no last-program branch.

The elements are y's, flattened ([M, n] contiguous, M * n of them): slot s of the
workspace holds element i at s * M * n + i (kernels/quant_matmul/gemv.py's layout).

Scatter (issue 28): when the next GEMV's weight has an act-order permutation (EXL2 always,
GPTQ with act-order), that GEMV reads its x through perm, a gathered load per row of x that
cost an 8B EXL2 model 1-3.4 us per GEMV on an H200. A slot sum whose output is that GEMV's x
can store column c of it at column `scatter[c]` (`split_k.row_order`, perm's inverse)
instead: the GEMV then reads x in its row order, contiguously, and adds the same products
in the same order (the same bits). Only for an output that nothing else reads.

With `silu_mul` the GEMV was a gated MLP's fused gate_up projection (output [gate | up],
n = 2I) and y is [M, I] = silu(gate) * up: each program sums the gate's and the up's slots
of its elements, rounds both to y's dtype (where the GEMV alone would have stored them) and
ends with kernels.activation's `silu_mul_rounded`, the silu_mul kernel's own expression.
Same bits as the GEMV followed by kernels.silu_mul, minus that launch and the [M, 2I]
intermediate's write and read (issue 31: the decode MLP pays for no kernel boundary there).

`launch_slot_sum_residual` ends a pre-norm block's o_proj or down_proj (issue 28): it writes
h = residual + y, rounded as kernels.add_rms_norm rounds it (y to the dtype first, as the
GEMV alone stores it, then the sum), each program's float32 pairwise sum of squares of its
chunk of h's row into `RowSquares` (one fixed slot per program) and, given the next norm's
weight w, xw = h * w (h * (1 + w) for Gemma's unit offset) in float32, exact. The next
GEMV reads xw as a plain x and its slot sum (`launch_slot_sum` with a `SlotNorm`) finishes
the norm: y = rstd * (sum of the slots) + bias, rstd = rsqrt(mean of squares + eps) of the
row from the RowSquares by kernels/rms_norm.py's fixed pairwise tree, in every program
alike. RMSNorm is h * rstd * w with rstd one scalar per row, and a GEMV is linear in x, so
rms_norm(h) @ W = rstd * ((h * w) @ W): the norm costs the GEMV nothing (applied per x
element it did, kernels/quant_matmul/gemv.py's docstring says why), and add_rms_norm's
launch is gone. The bits are not the unfused ops' (x is not rounded to 16 bits at all,
where rms_norm rounds h * rstd * w; rstd after the sum instead of before), but the same
every run: every sum has a fixed order.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.activation import silu_mul_rounded
from kernels.backend import (
    cast_rtne,
    is_interpreted,
    pdl_launch_dependents,
    pdl_wait,
    programmatic_launch,
)
from kernels.quant_matmul.split_k import sm_count
from kernels.quant_matmul.tiles import sum_slots
from kernels.rms_norm import pairwise_sum, rms_rstd


@dataclasses.dataclass(frozen=True)
class SlotSumConfig:
    """Launch settings of the slot sum: `block` elements of y per program, `num_warps`
    warps each (block / (32 * num_warps) elements per thread, each with a load per slot
    in flight)."""

    block: int
    num_warps: int


# Loads a thread may keep in flight (elements per thread * slots) before the registers run
# short: 8B GPTQ on an H100 has 3-65 slots per GEMV (twice the loads for gate_up with silu_mul).
_LOADS_PER_THREAD = 64
_MIN_BLOCK = 32
_MAX_BLOCK = 1024
_PROGRAMS_PER_SM = 2
_MAX_WARPS = 4


def _pow2_floor(value: int) -> int:
    return 1 << (max(value, 1).bit_length() - 1)


def slot_sum_config(elements: int, slots: int, device: torch.device) -> SlotSumConfig:
    """About _PROGRAMS_PER_SM programs per SM (every SM pulls its share of the partials
    from L2 at once), 32 to 1024 elements each, and few enough elements per thread (at
    most _MAX_WARPS warps) that every slot's load is in flight within _LOADS_PER_THREAD
    registers, or one element per thread."""
    per_thread = max(1, min(4, _pow2_floor(_LOADS_PER_THREAD // max(slots, 1))))
    block = _pow2_floor(triton.cdiv(elements, _PROGRAMS_PER_SM * sm_count(device)))
    block = max(_MIN_BLOCK, min(_MAX_BLOCK, _MAX_WARPS * 32 * per_thread, block))
    return SlotSumConfig(block, max(1, min(_MAX_WARPS, block // (32 * per_thread))))


@dataclasses.dataclass(frozen=True)
class RowSquares:
    """Partial sums of squares of h [M, n] for its RMSNorm: sums[m, c] (float32 [M, chunks])
    is kernels.rms_norm's `pairwise_sum` of h[m, c * chunk : (c + 1) * chunk] ** 2 (zeros
    past n), chunk a power of two, so the pairwise sum of sums[m] padded with zeros to a
    power of two is rms_norm's sum of squares of row m, bit for bit."""

    sums: torch.Tensor
    chunk: int

    @property
    def chunks(self) -> int:
        return int(self.sums.shape[1])


@dataclasses.dataclass(frozen=True)
class SlotNorm:
    """The rest of an RMSNorm for a slot sum whose GEMV read x = h * w (module docstring):
    each output of row m is scaled by row m's rstd, from `squares` (h's RowSquares, d = the
    norm's width: the GEMV's k) and eps."""

    squares: RowSquares
    d: int
    eps: float


@triton.jit
def row_rstd(squares_ptr, chunks, D, eps, row, CHUNKS_POW2: tl.constexpr):
    """Row `row`'s rstd from its RowSquares: the pairwise tree finished over the chunk sums
    (zeros past `chunks`), the bits of kernels.rms_norm's rstd of that row, in every
    program alike."""
    c = tl.arange(0, CHUNKS_POW2)
    part = tl.load(squares_ptr + row * chunks + c, mask=c < chunks, other=0.0)
    return rms_rstd(pairwise_sum(part, CHUNKS_POW2), D, eps)


@triton.jit
def _rstd_of_rows(
    row, squares_ptr, chunks, D, eps, M_ROWS: tl.constexpr, CHUNKS_POW2: tl.constexpr
):  # fmt: skip
    """The rstd of each element's row (`row` [BLOCK], < M_ROWS <= 4): the rows' rstds once
    per program (a scalar each), then picked per element."""
    rstd = row_rstd(squares_ptr, chunks, D, eps, 0, CHUNKS_POW2) + tl.zeros(row.shape, tl.float32)
    if M_ROWS > 1:
        rstd = tl.where(row == 1, row_rstd(squares_ptr, chunks, D, eps, 1, CHUNKS_POW2), rstd)
    if M_ROWS > 2:
        rstd = tl.where(row == 2, row_rstd(squares_ptr, chunks, D, eps, 2, CHUNKS_POW2), rstd)
    if M_ROWS > 3:
        rstd = tl.where(row == 3, row_rstd(squares_ptr, chunks, D, eps, 3, CHUNKS_POW2), rstd)
    return rstd


@triton.jit(do_not_specialize=["chunks", "norm_d"])
def _slot_sum_kernel(
    sums_ptr,  # float32 [SLOTS, M, n]: the workspace (see store_partial)
    y_ptr,  # [elements] (y [M, n], or [M, n / 2] with SILU_MUL, contiguous), any float dtype
    elements,  # y's
    width,  # y's row width (n, or n / 2 with SILU_MUL: the gate's columns, then the up's)
    bias_ptr,  # HAS_BIAS: the GEMV's bias [n], left out of its partials; else unused
    scatter_ptr,  # SCATTER: int32 [width], column c of y stored at column scatter[c]
    squares_ptr,  # NORM: float32 [M, chunks], the RowSquares of x's h; else unused
    chunks,
    norm_d,  # NORM: the norm's width (run time, as rms_norm passes it)
    eps,
    SLOTS: tl.constexpr,
    GROUP: tl.constexpr,  # max(SLOTS, 1): every slot's load unrolled (see sum_slots)
    BLOCK: tl.constexpr,
    SILU_MUL: tl.constexpr,  # y = silu(gate) * up of the [gate | up] sums (module docstring)
    NORM: tl.constexpr,  # each sum times its row's rstd (SlotNorm), before the bias
    HAS_BIAS: tl.constexpr,
    SCATTER: tl.constexpr,
    M_ROWS: tl.constexpr,  # NORM: y's rows (at most 4, the GEMV's)
    CHUNKS_POW2: tl.constexpr,  # NORM: chunks rounded up to a power of two
    USE_PDL: tl.constexpr,
    PRECISE_EXP: tl.constexpr,  # SILU_MUL: as kernels.activation's silu_mul kernel
    EMULATE_BF16: tl.constexpr,
):
    pdl_launch_dependents(USE_PDL)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < elements
    dtype = y_ptr.dtype.element_ty
    row = offsets // width
    col = offsets - row * width
    # The bias is a weight, never a kernel's output: loaded before the wait. Everything
    # else is the previous kernels' output.
    bias = tl.zeros([BLOCK], tl.float32)
    bias_up = bias
    if HAS_BIAS:
        bias = tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
        if SILU_MUL:
            bias_up = tl.load(bias_ptr + width + col, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    rstd = tl.full([BLOCK], 1.0, tl.float32)
    if NORM:
        rstd = _rstd_of_rows(row, squares_ptr, chunks, norm_d, eps, M_ROWS, CHUNKS_POW2)
    if SILU_MUL:
        # Element (m, c) of y: the gate at m * n + c of a slot, the up n / 2 after it.
        gate_at = offsets + row * width
        gate = sum_slots(sums_ptr, 2 * elements, gate_at, mask, SLOTS, GROUP)
        up = sum_slots(sums_ptr, 2 * elements, gate_at + width, mask, SLOTS, GROUP)
        if NORM:
            gate = gate * rstd
            up = up * rstd
        if HAS_BIAS:
            gate = gate + bias
            up = up + bias_up
        gate = cast_rtne(gate, dtype, EMULATE_BF16).to(tl.float32)
        up = cast_rtne(up, dtype, EMULATE_BF16).to(tl.float32)
        out = silu_mul_rounded(gate, up, dtype, PRECISE_EXP, EMULATE_BF16)
    else:
        sums = sum_slots(sums_ptr, elements, offsets, mask, SLOTS, GROUP)
        if NORM:
            sums = sums * rstd
        if HAS_BIAS:
            sums = sums + bias
        out = cast_rtne(sums, dtype, EMULATE_BF16)
    store_at = offsets
    if SCATTER:
        # Loaded here, after the sums, although it is a weight: loaded anywhere before them
        # (before the PDL wait too) ptxas issued the slot loads one at a time, each before
        # its add, and an 8B gate_up's slot sum took 5.6 us more on an H200 (bench/results/
        # 2026-11-29-h200-exl2-row-order-s22.json); here they stay in flight together.
        store_at = row * width + tl.load(scatter_ptr + col, mask=mask, other=0)
    tl.store(y_ptr + store_at, out, mask=mask)


# Triton 3.6's interpreter truncates float32 -> bfloat16 (kernels.backend.cast_rtne) and has
# no libdevice (kernels.activation).
_INTERPRETED = is_interpreted(_slot_sum_kernel)


def _check_norm(y: torch.Tensor, norm: SlotNorm) -> None:
    if y.dim() != 2 or not 0 < y.shape[0] <= 4:
        raise ValueError(f"a SlotNorm takes y as [M <= 4, n], got shape {tuple(y.shape)}")
    check_slot_norm(y.shape[0], norm)


def check_scatter(scatter: torch.Tensor, out: torch.Tensor, what: str) -> None:
    """That `scatter` can place the columns of `out` [M, width]: int32 [width], contiguous,
    on out's device. (That it is a permutation is split_k.row_order's to ensure.)"""
    if out.dim() != 2:
        raise ValueError(f"a scatter takes {what} as [M, n], got shape {tuple(out.shape)}")
    width = out.shape[1]
    if (
        scatter.dtype != torch.int32
        or scatter.shape != (width,)
        or not scatter.is_contiguous()
        or scatter.device != out.device
    ):
        raise ValueError(
            f"scatter must be a contiguous int32 [{width}] on {out.device}, got "
            f"{scatter.dtype} {tuple(scatter.shape)} on {scatter.device}"
        )


def check_slot_norm(rows: int, norm: SlotNorm) -> None:
    """That `norm`'s squares hold float32 [rows, chunks] of a power-of-two chunk."""
    sq = norm.squares
    chunks = triton.cdiv(norm.d, sq.chunk)
    if sq.sums.shape != (rows, chunks) or sq.sums.dtype != torch.float32:
        raise ValueError(
            f"squares must be float32 [{rows}, {chunks}], got "
            f"{sq.sums.dtype} {tuple(sq.sums.shape)}"
        )
    if sq.chunk & (sq.chunk - 1) or not sq.sums.is_contiguous():
        raise ValueError("squares must be contiguous, in chunks of a power of two")


def launch_slot_sum(
    sums: torch.Tensor,
    y: torch.Tensor,
    slots: int,
    *,
    silu_mul: bool = False,
    norm: SlotNorm | None = None,
    bias: torch.Tensor | None = None,
    scatter: torch.Tensor | None = None,
    pdl: bool | None = None,
    config: SlotSumConfig | None = None,
) -> None:
    """y (contiguous, M * n elements) = sum over slots 0..slots-1 of sums[slot * y.numel() +
    i], in slot order, rounded once to y's dtype. `norm`: each sum is first multiplied by
    its row's rstd (the GEMV read x = h * w: module docstring). `bias` ([n]; y [M, n]):
    added after that, unscaled (the GEMV left it out of its partials). `silu_mul`: the
    slots hold [M, 2 * I] sums ([gate | up] per row) and y [M, I] gets silu(gate) * up,
    each sum (scaled, biased) rounded to y's dtype first (module docstring). `scatter`
    (int32 [I], y [M, I]): column c of y is stored at column scatter[c], the next GEMV's
    row order (module docstring). `pdl`: launch
    with programmatic dependent launch (default: where kernels.backend.programmatic_launch
    says; pass False after a join of streams, whose other branch PDL would not wait for).
    `config`: the default `slot_sum_config` unless given (benchmarks sweep it)."""
    elements = y.numel()
    if not y.is_contiguous():
        raise ValueError(f"y must be contiguous, got strides {y.stride()}")
    if (silu_mul or bias is not None) and y.dim() != 2:
        raise ValueError(f"silu_mul and bias take y as [M, I], got shape {tuple(y.shape)}")
    read = 2 * elements if silu_mul else elements  # per slot
    if sums.dtype != torch.float32 or sums.numel() < slots * read:
        raise ValueError(
            f"sums must be float32 with at least {slots} x {read} elements, got "
            f"{sums.dtype} x {sums.numel()}"
        )
    width = y.shape[-1] if y.dim() == 2 else 1
    if bias is not None and bias.shape != ((2 if silu_mul else 1) * width,):
        raise ValueError(f"bias must be [{(2 if silu_mul else 1) * width}]")
    if norm is not None:
        _check_norm(y, norm)
    if scatter is not None:
        check_scatter(scatter, y, "y")
    if elements == 0:
        return
    use_pdl = programmatic_launch(y) if pdl is None else pdl and programmatic_launch(y)
    # Each element reads a gate and an up per slot with silu_mul: twice the loads in flight.
    loads = slots * (2 if silu_mul else 1)
    c = config if config is not None else slot_sum_config(elements, loads, y.device)
    squares = norm.squares if norm is not None else None
    _slot_sum_kernel[(triton.cdiv(elements, c.block),)](
        sums,
        y,
        elements,
        width,
        bias.contiguous() if bias is not None else sums,  # a dummy pointer when absent
        scatter if scatter is not None else sums,
        squares.sums if squares is not None else sums,
        squares.chunks if squares is not None else 1,
        norm.d if norm is not None else 1,
        float(norm.eps) if norm is not None else 0.0,
        SLOTS=slots,
        GROUP=max(slots, 1),
        BLOCK=c.block,
        SILU_MUL=silu_mul,
        NORM=norm is not None,
        HAS_BIAS=bias is not None,
        SCATTER=scatter is not None,
        M_ROWS=y.shape[0] if norm is not None else 1,
        CHUNKS_POW2=triton.next_power_of_2(squares.chunks) if squares is not None else 1,
        USE_PDL=use_pdl,
        PRECISE_EXP=not _INTERPRETED,  # the interpreter has no libdevice
        EMULATE_BF16=_INTERPRETED,
        num_warps=c.num_warps,
        # Adds and one multiply, never contracted into an FMA (the unfused GEMV's rounding
        # of the sum); silu_mul_rounded must not contract either (see kernels.activation).
        enable_fp_fusion=False,
        launch_pdl=use_pdl,
    )


@triton.jit
def _slot_sum_residual_kernel(
    sums_ptr,  # float32 [SLOTS, M, n]: the workspace (see store_partial)
    residual_ptr,  # [M, n] contiguous, h's dtype
    h_ptr,  # [M, n] contiguous: residual + y
    squares_ptr,  # float32 [M, chunks]: RowSquares.sums
    norm_w_ptr,  # XW: the next RMSNorm's weight [n], h's dtype; else unused
    xw_ptr,  # XW: float32 [M, n] contiguous: h * w (h * (1 + w), UNIT_OFFSET), exact
    xw_scatter_ptr,  # XW_SCATTER: int32 [n], column c of xw stored at column scatter[c]
    n,
    elements,  # M * n: the workspace's slot stride
    chunks,
    SLOTS: tl.constexpr,
    GROUP: tl.constexpr,  # max(SLOTS, 1): every slot's load unrolled (see sum_slots)
    BLOCK: tl.constexpr,  # the chunk: a power of two
    XW: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,  # XW: Gemma's (1 + w)
    XW_SCATTER: tl.constexpr,  # XW: in the next GEMV's row order (module docstring)
    USE_PDL: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    pdl_launch_dependents(USE_PDL)
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    offsets = row * n + cols
    dtype = h_ptr.dtype.element_ty
    w = tl.zeros([BLOCK], tl.float32)
    if XW:  # a weight: loaded before the wait
        w = tl.load(norm_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            w = 1.0 + w  # as kernels.rms_norm's y * (1 + w)
    xw_at = offsets
    if XW_SCATTER:  # a weight's permutation: before the wait too
        xw_at = row * n + tl.load(xw_scatter_ptr + cols, mask=mask, other=0)
    # The residual is an earlier kernel's output: loaded after the wait.
    pdl_wait(USE_PDL)
    y = cast_rtne(sum_slots(sums_ptr, elements, offsets, mask, SLOTS, GROUP), dtype, EMULATE_BF16)
    r = tl.load(residual_ptr + offsets, mask=mask, other=0.0)
    # add_rms_norm's x + residual: both rounded to the dtype, added in float32, rounded once.
    h = cast_rtne(y.to(tl.float32) + r.to(tl.float32), dtype, EMULATE_BF16)
    tl.store(h_ptr + offsets, h, mask=mask)
    hf = h.to(tl.float32)  # 0 past n
    tl.store(squares_ptr + row * chunks + chunk, pairwise_sum(hf * hf, BLOCK))
    if XW:
        # Kept in float32, where h * w of two 16-bit floats is exact: rounded to h's dtype it
        # would overflow float16 where a residual channel is large (h 20,000 times w 4 is
        # past 65,504; rms_norm rounds the far smaller h * rstd * w) and lose bits in
        # float16's subnormals where h and w are small.
        tl.store(xw_ptr + xw_at, hf * w, mask=mask)


def launch_slot_sum_residual(
    sums: torch.Tensor,
    residual: torch.Tensor,
    h: torch.Tensor,
    slots: int,
    *,
    norm_weight: torch.Tensor | None = None,
    unit_offset: bool = False,
    xw: torch.Tensor | None = None,
    xw_scatter: torch.Tensor | None = None,
    pdl: bool | None = None,
    config: SlotSumConfig | None = None,
) -> RowSquares:
    """h [M, n] = residual + (the sum over slots 0..slots-1 of the workspace, in slot order,
    rounded to h's dtype), rounded once more: kernels.add_rms_norm's residual output, bit
    for bit, for a GEMV's y. Returns h's `RowSquares` (chunk = the program's block, a row
    never straddles two programs). With `norm_weight` (the next RMSNorm's, [n] in h's
    dtype) also writes xw [M, n] = h * w, or h * (1 + w) with `unit_offset`, in float32
    (exact): the next GEMV's x (module docstring), with column c at column xw_scatter[c]
    when given (the next GEMV's row order: `launch_slot_sum`'s scatter). `pdl` and
    `config` as for `launch_slot_sum`."""
    if h.dim() != 2 or not h.is_contiguous() or h.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"h must be a contiguous float16/bfloat16 [M, n], got {h.dtype} {tuple(h.shape)}"
        )
    if residual.shape != h.shape or residual.dtype != h.dtype or not residual.is_contiguous():
        raise ValueError(f"residual must be a contiguous {h.dtype} {tuple(h.shape)}")
    M, n = h.shape
    if sums.dtype != torch.float32 or sums.numel() < slots * M * n:
        raise ValueError(
            f"sums must be float32 with at least {slots} x {M * n} elements, got "
            f"{sums.dtype} x {sums.numel()}"
        )
    if (norm_weight is None) != (xw is None):
        raise ValueError("norm_weight and xw come together")
    if norm_weight is not None and (
        norm_weight.shape != (n,) or norm_weight.dtype != h.dtype or not norm_weight.is_contiguous()
    ):
        raise ValueError(f"norm_weight must be a contiguous {h.dtype} [{n}]")
    if xw is not None and (
        xw.shape != h.shape or xw.dtype != torch.float32 or not xw.is_contiguous()
    ):
        raise ValueError(f"xw must be a contiguous float32 {tuple(h.shape)}")
    if xw_scatter is not None:
        if xw is None:
            raise ValueError("xw_scatter places xw: it needs norm_weight and xw")
        check_scatter(xw_scatter, xw, "xw")
    c = config if config is not None else slot_sum_config(M * n, slots, h.device)
    chunks = triton.cdiv(n, c.block)
    squares = RowSquares(torch.empty((M, chunks), dtype=torch.float32, device=h.device), c.block)
    if M * n == 0:
        return squares
    use_pdl = programmatic_launch(h) if pdl is None else pdl and programmatic_launch(h)
    _slot_sum_residual_kernel[(chunks, M)](
        sums,
        residual,
        h,
        squares.sums,
        norm_weight if norm_weight is not None else h,  # dummy pointers when absent
        xw if xw is not None else h,
        xw_scatter if xw_scatter is not None else h,
        n,
        M * n,
        chunks,
        SLOTS=slots,
        GROUP=max(slots, 1),
        BLOCK=c.block,
        XW=xw is not None,
        UNIT_OFFSET=unit_offset,
        XW_SCATTER=xw_scatter is not None,
        USE_PDL=use_pdl,
        EMULATE_BF16=_INTERPRETED,
        num_warps=c.num_warps,
        enable_fp_fusion=False,  # adds, squares and one multiply, each rounded alone
        launch_pdl=use_pdl,
    )
    return squares
