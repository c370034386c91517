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

With `silu_mul` the GEMV was a gated MLP's fused gate_up projection (output [gate | up],
n = 2I) and y is [M, I] = silu(gate) * up: each program sums the gate's and the up's slots
of its elements, rounds both to y's dtype (where the GEMV alone would have stored them) and
ends with kernels.activation's `silu_mul_rounded`, the silu_mul kernel's own expression.
Same bits as the GEMV followed by kernels.silu_mul, minus that launch and the [M, 2I]
intermediate's write and read (issue 31: the decode MLP pays for no kernel boundary there).

`launch_slot_sum_residual` ends a pre-norm block's o_proj or down_proj (issue 28): it writes
h = residual + y, rounded as kernels.add_rms_norm rounds it (y to the dtype first, as the
GEMV alone stores it, then the sum), and each program's float32 pairwise sum of squares of
its chunk of h's row into `RowSquares` (one fixed slot per program). The next GEMV finishes
the norm's pairwise tree from those slots and applies the norm to x as it loads it
(kernels/quant_matmul/gemv.py): add_rms_norm's launch is gone, its bits are not.
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
from kernels.rms_norm import pairwise_sum


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


@triton.jit
def _slot_sum_kernel(
    sums_ptr,  # float32 [SLOTS, M, n]: the workspace (see store_partial)
    y_ptr,  # [elements] (y [M, n], or [M, n / 2] with SILU_MUL, contiguous), any float dtype
    elements,  # y's
    half,  # SILU_MUL: n / 2, y's row width (the gate's columns, then the up's)
    SLOTS: tl.constexpr,
    GROUP: tl.constexpr,  # max(SLOTS, 1): every slot's load unrolled (see sum_slots)
    BLOCK: tl.constexpr,
    SILU_MUL: tl.constexpr,  # y = silu(gate) * up of the [gate | up] sums (module docstring)
    USE_PDL: tl.constexpr,
    PRECISE_EXP: tl.constexpr,  # SILU_MUL: as kernels.activation's silu_mul kernel
    EMULATE_BF16: tl.constexpr,
):
    # Nothing to load before the wait: every input is the previous kernel's output.
    pdl_launch_dependents(USE_PDL)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < elements
    dtype = y_ptr.dtype.element_ty
    pdl_wait(USE_PDL)
    if SILU_MUL:
        # Element (m, c) of y: the gate at m * n + c of a slot, the up n / 2 after it.
        gate_at = offsets + (offsets // half) * half
        gate = sum_slots(sums_ptr, 2 * elements, gate_at, mask, SLOTS, GROUP)
        up = sum_slots(sums_ptr, 2 * elements, gate_at + half, mask, SLOTS, GROUP)
        gate = cast_rtne(gate, dtype, EMULATE_BF16).to(tl.float32)
        up = cast_rtne(up, dtype, EMULATE_BF16).to(tl.float32)
        out = silu_mul_rounded(gate, up, dtype, PRECISE_EXP, EMULATE_BF16)
    else:
        sums = sum_slots(sums_ptr, elements, offsets, mask, SLOTS, GROUP)
        out = cast_rtne(sums, dtype, EMULATE_BF16)
    tl.store(y_ptr + offsets, out, mask=mask)


# Triton 3.6's interpreter truncates float32 -> bfloat16 (kernels.backend.cast_rtne) and has
# no libdevice (kernels.activation).
_INTERPRETED = is_interpreted(_slot_sum_kernel)


def launch_slot_sum(
    sums: torch.Tensor,
    y: torch.Tensor,
    slots: int,
    *,
    silu_mul: bool = False,
    pdl: bool | None = None,
    config: SlotSumConfig | None = None,
) -> None:
    """y (contiguous, M * n elements) = sum over slots 0..slots-1 of sums[slot * y.numel() +
    i], in slot order, rounded once to y's dtype. `silu_mul`: the slots hold [M, 2 * I]
    sums ([gate | up] per row) and y [M, I] gets silu(gate) * up, each sum rounded to y's
    dtype first (module docstring). `pdl`: launch with programmatic dependent launch
    (default: where kernels.backend.programmatic_launch says; pass False after a join of
    streams, whose other branch PDL would not wait for). `config`: the default
    `slot_sum_config` unless given (benchmarks sweep it)."""
    elements = y.numel()
    if not y.is_contiguous():
        raise ValueError(f"y must be contiguous, got strides {y.stride()}")
    if silu_mul and y.dim() != 2:
        raise ValueError(f"silu_mul takes y as [M, I], got shape {tuple(y.shape)}")
    read = 2 * elements if silu_mul else elements  # per slot
    if sums.dtype != torch.float32 or sums.numel() < slots * read:
        raise ValueError(
            f"sums must be float32 with at least {slots} x {read} elements, got "
            f"{sums.dtype} x {sums.numel()}"
        )
    if elements == 0:
        return
    use_pdl = programmatic_launch(y) if pdl is None else pdl and programmatic_launch(y)
    # Each element reads a gate and an up per slot with silu_mul: twice the loads in flight.
    loads = slots * (2 if silu_mul else 1)
    c = config if config is not None else slot_sum_config(elements, loads, y.device)
    _slot_sum_kernel[(triton.cdiv(elements, c.block),)](
        sums,
        y,
        elements,
        y.shape[-1] if silu_mul else 1,
        SLOTS=slots,
        GROUP=max(slots, 1),
        BLOCK=c.block,
        SILU_MUL=silu_mul,
        USE_PDL=use_pdl,
        PRECISE_EXP=not _INTERPRETED,  # the interpreter has no libdevice
        EMULATE_BF16=_INTERPRETED,
        num_warps=c.num_warps,
        # The sums are adds only; silu_mul_rounded must not contract (see kernels.activation).
        enable_fp_fusion=False,
        launch_pdl=use_pdl,
    )


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


@triton.jit
def _slot_sum_residual_kernel(
    sums_ptr,  # float32 [SLOTS, M, n]: the workspace (see store_partial)
    residual_ptr,  # [M, n] contiguous, h's dtype
    h_ptr,  # [M, n] contiguous: residual + y
    squares_ptr,  # float32 [M, chunks]: RowSquares.sums
    n,
    elements,  # M * n: the workspace's slot stride
    chunks,
    SLOTS: tl.constexpr,
    GROUP: tl.constexpr,  # max(SLOTS, 1): every slot's load unrolled (see sum_slots)
    BLOCK: tl.constexpr,  # the chunk: a power of two
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
    # The residual too is an earlier kernel's output: every load after the wait.
    pdl_wait(USE_PDL)
    y = cast_rtne(sum_slots(sums_ptr, elements, offsets, mask, SLOTS, GROUP), dtype, EMULATE_BF16)
    r = tl.load(residual_ptr + offsets, mask=mask, other=0.0)
    # add_rms_norm's x + residual: both rounded to the dtype, added in float32, rounded once.
    h = cast_rtne(y.to(tl.float32) + r.to(tl.float32), dtype, EMULATE_BF16)
    tl.store(h_ptr + offsets, h, mask=mask)
    hf = h.to(tl.float32)  # 0 past n
    tl.store(squares_ptr + row * chunks + chunk, pairwise_sum(hf * hf, BLOCK))


def launch_slot_sum_residual(
    sums: torch.Tensor,
    residual: torch.Tensor,
    h: torch.Tensor,
    slots: int,
    *,
    pdl: bool | None = None,
    config: SlotSumConfig | None = None,
) -> RowSquares:
    """h [M, n] = residual + (the sum over slots 0..slots-1 of the workspace, in slot order,
    rounded to h's dtype), rounded once more: kernels.add_rms_norm's residual output, bit
    for bit, for a GEMV's y. Returns h's `RowSquares` (chunk = the program's block, a row
    never straddles two programs). `pdl` and `config` as for `launch_slot_sum`."""
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
        n,
        M * n,
        chunks,
        SLOTS=slots,
        GROUP=max(slots, 1),
        BLOCK=c.block,
        USE_PDL=use_pdl,
        EMULATE_BF16=_INTERPRETED,
        num_warps=c.num_warps,
        enable_fp_fusion=False,  # adds and squares only (module docstring)
        launch_pdl=use_pdl,
    )
    return squares
