"""The push all-reduce of a row-parallel decode GEMV straight from its split-K slots, one
program per chunk of a row, optionally with the residual add + RMSNorm after it (issue 33).

Today a site all-reduce is three kernels: the GEMV's programs store their partials in the
workspace slots, the slot sum adds them into the site's float32 slice, and the push kernel
(kernels/tp_push_all_reduce.py, one program per row) exchanges the slice with the peers
and ends with the norm. On 2 H100s (8B, TP=2) the 64 slot sums of a step cost ~130 µs of
its critical path. Here one kernel does what the slot sum and the push kernel did, with
`CHUNK` columns per program, so every program's slot loads, pushes and polls run side by
side over many SMs (one program per row reading every slot would be the serial read the
slot sum was built to avoid):

  1. waits for the GEMV (PDL), takes its (row, chunk)'s next receive slot,
  2. sums its columns' partials over the GEMV's slots in slot order (kernels/quant_matmul/
     tiles.py sum_slots: the slot sum's bits),
  3. pushes them into every peer's receive cell and polls its own (the push kernel's
     protocol, per chunk: the cells are the push kernel's, each chunk its columns of them,
     each (row, chunk) with its own slot),
  4. sums the ranks' partials in rank order and, without the norm, stores the cast sum.
  With the norm it stores h = residual + sum (rounded as kernels.add_rms_norm rounds it)
  and its chunk's pairwise sum of squares, then counts itself in: the row's last chunk
  program to arrive (an atomic count, reset by that program for the next call) reads every
  chunk's sum, finishes kernels/rms_norm.py's pairwise tree (chunks are its subtrees), and
  writes the whole row's norm from the stored h. No program waits for another of its own
  kernel (the Triton interpreter runs them one after the other), and the bits are those
  of the slot sum followed by push_all_reduce_add_rms_norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.backend import (
    cast_rtne,
    device_guard,
    is_interpreted,
    pdl_launch_dependents,
    pdl_wait,
    programmatic_launch,
)
from kernels.quant_matmul.tiles import sum_slots
from kernels.rms_norm import pairwise_sum, rms_norm_scale, rms_rstd
from kernels.tp_all_reduce import ending_operands, norm_outputs, peer_timeout_ns
from kernels.tp_push_all_reduce import RECV_SLOTS, PushBuffers, push_and_sum

# Columns per program: 4 per thread of 4 warps, a 16-byte push per thread.
CHUNK = 512
CHUNK_WARPS = 4
# Slot loads a thread keeps in flight (sum_slots' GROUP): 4 columns x 16 slots.
_LOADS_PER_THREAD = 64


@dataclass(frozen=True)
class ChunkState:
    """One rank's local state of the chunked kernel, beside its PushBuffers: `slots` int32
    [max_rows, max_chunks], each (row, chunk)'s next receive slot (zero at first);
    `arrivals` int32 [max_rows], the chunk programs of a row that finished the current
    call (zero between calls); `squares` float32 [max_rows, max_chunks], each chunk's sum
    of squares of h for the row's last program."""

    slots: torch.Tensor
    arrivals: torch.Tensor
    squares: torch.Tensor
    max_chunks: int


def chunk_state(push: PushBuffers, device: torch.device) -> ChunkState:
    """A fresh ChunkState for `push`'s rows and cells."""
    max_chunks = triton.next_power_of_2(triton.cdiv(push.row_floats, CHUNK))
    return ChunkState(
        slots=torch.zeros(push.max_rows, max_chunks, dtype=torch.int32, device=device),
        arrivals=torch.zeros(push.max_rows, dtype=torch.int32, device=device),
        squares=torch.zeros(push.max_rows, max_chunks, dtype=torch.float32, device=device),
        max_chunks=max_chunks,
    )


@triton.jit
def _release_fence(FENCE: tl.constexpr):
    """Make this thread's earlier stores visible GPU-wide before the arrival count (each
    thread stored its part of h; the row's last program reads all of it). The interpreter
    runs programs one after the other: nothing to order."""
    if FENCE:
        tl.inline_asm_elementwise(
            "fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _push_from_slots_kernel(
    sums_ptr,  # float32 [K_SLOTS, rows, D]: the GEMV's partials (its workspace)
    recv_bases_ptr,  # int64 [WORLD]: every rank's receive region (int32 words)
    slot_ptr,  # int32 [MAX_ROWS, MAX_CHUNKS]: each (row, chunk)'s next receive slot
    arrivals_ptr,  # int32 [MAX_ROWS]: ADD_NORM's count of finished chunk programs
    squares_ptr,  # float32 [MAX_ROWS, MAX_CHUNKS]: ADD_NORM's chunk sums of squares
    residual_ptr,  # ADD_NORM: the residual stream; else unused (out)
    weight_ptr,  # ADD_NORM: the norm's weight; else unused (out)
    out_ptr,  # the sum (activation dtype), or with ADD_NORM its norm
    residual_out_ptr,  # ADD_NORM: residual + sum; else unused (out)
    rank,
    rows,
    D,
    eps,
    row_floats,
    out_row_stride,
    residual_row_stride,
    residual_out_row_stride,
    WORLD: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
    CHUNKS: tl.constexpr,  # chunk programs per row: cdiv(D, CHUNK_COLS)
    SLOTS: tl.constexpr,
    K_SLOTS: tl.constexpr,  # the GEMV's split-K slots
    GROUP: tl.constexpr,  # sum_slots' loads in flight
    ADD_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    CHUNK_COLS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
    MAX_SPINS: tl.constexpr,  # 0 in the engine; tests bound the polls (poll_cell)
    TIMEOUT_NS: tl.constexpr,  # the engine's bound on GPUs (peer_timeout_ns)
    FENCE: tl.constexpr,  # GPUs: _release_fence before the arrival count
):
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    state = row * MAX_CHUNKS + chunk
    slot = tl.load(slot_ptr + state, volatile=True)
    # Every warp has read the slot before one thread stores the next (see the push kernel).
    tl.debug_barrier()
    tl.store(slot_ptr + state, (slot + 1) % SLOTS)
    cols = chunk * CHUNK_COLS + tl.arange(0, CHUNK_COLS)
    mask = cols < D
    mine = sum_slots(sums_ptr, rows * D, row * D + cols, mask, K_SLOTS, GROUP)
    acc = push_and_sum(
        mine, cols, mask, recv_bases_ptr, rank, slot, row, row_floats,
        WORLD, MAX_ROWS, MAX_SPINS, TIMEOUT_NS,
    )  # fmt: skip
    out_row = out_ptr + row.to(tl.int64) * out_row_stride
    if ADD_NORM:
        x_dtype = residual_ptr.dtype.element_ty
        x = cast_rtne(acc, x_dtype, EMULATE_BF16).to(tl.float32)
        r = tl.load(
            residual_ptr + row.to(tl.int64) * residual_row_stride + cols, mask=mask, other=0.0
        )
        summed = cast_rtne(x + r.to(tl.float32), x_dtype, EMULATE_BF16)
        h_row = residual_out_ptr + row.to(tl.int64) * residual_out_row_stride
        tl.store(h_row + cols, summed, mask=mask)
        h = tl.where(mask, summed.to(tl.float32), 0.0)
        tl.store(squares_ptr + state, pairwise_sum(h * h, CHUNK_COLS))
        _release_fence(FENCE)
        tl.debug_barrier()  # every thread's stores (and fence) before the count
        arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == CHUNKS - 1:
            # The row's last chunk program: every other one has stored its h and sum.
            tl.store(arrivals_ptr + row, 0)
            lanes = tl.arange(0, MAX_CHUNKS)
            parts = tl.load(
                squares_ptr + row * MAX_CHUNKS + lanes, mask=lanes < CHUNKS, other=0.0,
                volatile=True,
            )  # fmt: skip
            rstd = rms_rstd(pairwise_sum(parts, MAX_CHUNKS), D, eps)
            for c in tl.static_range(CHUNKS):
                cc = c * CHUNK_COLS + tl.arange(0, CHUNK_COLS)
                m = cc < D
                hc = tl.load(h_row + cc, mask=m, other=0.0, volatile=True).to(tl.float32)
                w = tl.load(weight_ptr + cc, mask=m, other=0.0).to(tl.float32)
                normed = rms_norm_scale(hc, w, rstd, x_dtype, UNIT_OFFSET, EMULATE_BF16)
                tl.store(
                    out_row + cc, cast_rtne(normed, out_ptr.dtype.element_ty, EMULATE_BF16), mask=m
                )
    else:
        tl.store(out_row + cols, cast_rtne(acc, out_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


_INTERPRETED = is_interpreted(_push_from_slots_kernel)


def _launch(
    sums: torch.Tensor,
    k_slots: int,
    push: PushBuffers,
    state: ChunkState,
    rows: int,
    hidden: int,
    out: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    eps: float,
    unit_offset: bool,
    max_spins: int,
) -> None:
    if not push.fits(rows, hidden):
        raise ValueError(f"{rows}x{hidden} does not fit the receive cells")
    if sums.dtype != torch.float32 or sums.numel() < k_slots * rows * hidden:
        raise ValueError(
            f"the GEMV's workspace holds {sums.numel()} float32 elements, fewer than "
            f"{k_slots} slots of {rows}x{hidden}"
        )
    add_norm, residual, weight, residual_out = ending_operands(out, residual, weight, residual_out)
    chunks = triton.cdiv(hidden, CHUNK)
    per_thread = CHUNK // (32 * CHUNK_WARPS)
    group = max(1, min(k_slots, _LOADS_PER_THREAD // per_thread))
    pdl = programmatic_launch(out)
    with device_guard(out):
        _push_from_slots_kernel[(rows, chunks)](
            sums,
            push.recv_bases,
            state.slots,
            state.arrivals,
            state.squares,
            residual,
            weight,
            out,
            residual_out,
            push.rank,
            rows,
            hidden,
            float(eps),
            push.row_floats,
            out.stride(0),
            residual.stride(0),
            residual_out.stride(0),
            WORLD=push.world,
            MAX_ROWS=push.max_rows,
            MAX_CHUNKS=state.max_chunks,
            CHUNKS=chunks,
            SLOTS=RECV_SLOTS,
            K_SLOTS=k_slots,
            GROUP=group,
            ADD_NORM=add_norm,
            UNIT_OFFSET=unit_offset,
            CHUNK_COLS=CHUNK,
            EMULATE_BF16=_INTERPRETED,
            USE_PDL=pdl,
            MAX_SPINS=max_spins,
            TIMEOUT_NS=peer_timeout_ns(_INTERPRETED),
            FENCE=not _INTERPRETED,
            num_warps=CHUNK_WARPS,
            launch_pdl=pdl,
        )


def push_from_slots(
    sums: torch.Tensor,
    k_slots: int,
    push: PushBuffers,
    state: ChunkState,
    rows: int,
    hidden: int,
    dtype: torch.dtype,
    *,
    max_spins: int = 0,
) -> torch.Tensor:
    """The rank-order sum over the ranks of the GEMV's [rows, hidden] output whose partials
    fill the first `k_slots` slots of `sums` (kernels/quant_matmul/gemv.py
    launch_gemv_to_slots), rounded to `dtype`: the bits of the slot sum followed by
    kernels/tp_push_all_reduce.py's push_all_reduce, in one kernel. `max_spins`: tests."""
    out = torch.empty(rows, hidden, dtype=dtype, device=sums.device)
    _launch(sums, k_slots, push, state, rows, hidden, out, None, None, None, 0.0, False, max_spins)
    return out


def push_from_slots_add_rms_norm(
    sums: torch.Tensor,
    k_slots: int,
    push: PushBuffers,
    state: ChunkState,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
    max_spins: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.add_rms_norm(sum, residual, weight, eps)` on what `push_from_slots(...,
    residual.dtype)` returns, in one kernel: (normed, residual + sum)."""
    out, summed = norm_outputs(residual, weight, unit_offset)
    rows, hidden = residual.shape
    _launch(
        sums,
        k_slots,
        push,
        state,
        rows,
        hidden,
        out,
        residual,
        weight.contiguous(),
        summed,
        eps,
        unit_offset,
        max_spins,
    )
    return out, summed
