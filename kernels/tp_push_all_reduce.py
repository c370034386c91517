"""The decode all-reduce of tensor parallelism by pushing partials into the peers' memory
(a Lamport-style exchange), optionally fused with the residual add + RMSNorm after it.

kernels/tp_all_reduce.py's kernel publishes a flag into every peer (a remote atomic), waits
for the peers' flags, then reads the peers' partials over NVLink: two remote round trips
per call, about 8 µs on 2 H100s. Here each rank stores its partial straight into every
peer's receive cell and polls only its own memory: one posted remote write, no flag, no
remote read.

Every rank holds a receive region that every rank can address (torch's symmetric memory
over NVLink on GPUs; plain CPU tensors in the tests), int32 words:

    recv: [RECV_SLOTS, world, max_rows, row_floats]   recv[slot, q, row]: rank q's partial
                                                      of this rank's call, as float32 bits

Every word holds SENTINEL (a NaN bit pattern) until a peer's partial lands in it. The
partial is stored word by word; a 4-byte store lands whole, so a word that is no longer
SENTINEL holds its final value, and a cell with no SENTINEL left is complete. No partial
word is ever SENTINEL: the sender turns that bit pattern (a NaN) into CANONICAL_NAN.

A call (one program per row; `slots`, local, hold each row's next slot in device memory so
a CUDA graph replays the same launches with advancing slots; the slot itself is kept, not a
call count, which would wrap past 2**31 calls, days of serving, into negative slots):
  1. waits for the previous kernel (PDL: the GEMV's partial in this rank's site slice),
  2. takes slot = slots[row] and stores (slot + 1) % RECV_SLOTS,
  3. stores its partial into recv[slot, rank, row] of every peer,
  4. polls its own recv[slot, q, row] for every peer q until no word is SENTINEL, then
     stores SENTINEL back (the cell is free for call c + RECV_SLOTS),
  5. sums the partials in rank order (its own from registers), so every rank computes the
     same float32 operations and holds the same bits, and ends as kernels/tp_all_reduce.py
     does (store_reduced: the cast, or the residual add + RMSNorm).

Why a peer never writes into a cell before it was reset. Rank q writes cell (slot, q,
row) of rank r for call c + RECV_SLOTS only after its call c + RECV_SLOTS - 1 of that row
completed, which waited for r's push of that call, which r makes after its PDL wait, so
after r's kernel of call c (which read and reset the cell) completed. Both ranks make the
same calls with the same rows in the same order (the same model on the same batches), so
each row's call count agrees on every rank. Two slots would do (a peer's call c + 2 waits
for this rank's push of c + 1, made after its kernel of call c); one more is kept.

Why it cannot deadlock. A program pushes before it polls, and polls only for the peers'
programs of the same row and call. By induction over the common call sequence every
rank reaches call c, pushes, and every poll of call c ends. With PDL the next kernel
launches only once every program of this one has started, so the programs this kernel
waits on are never kept from running by its successors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.backend import (
    device_guard,
    is_interpreted,
    pdl_launch_dependents,
    pdl_wait,
    programmatic_launch,
)
from kernels.rms_norm import norm_num_warps
from kernels.tp_all_reduce import (
    SiteBuffers,
    check_site_call,
    ending_operands,
    global_ns,
    norm_outputs,
    peer_timeout_ns,
    stop_if_late,
    store_reduced,
)

# Cells per (peer, row): a cell is reused RECV_SLOTS calls later (see the module docstring).
RECV_SLOTS = 3
# A NaN no partial carries (0xFFFFFFFF): a receive word not yet written.
SENTINEL = -1
# What a partial word with SENTINEL's bits is sent as (the quiet NaN 0x7FC00000).
CANONICAL_NAN = 0x7FC00000
_SENTINEL: tl.constexpr = tl.constexpr(SENTINEL)
_CANONICAL_NAN: tl.constexpr = tl.constexpr(CANONICAL_NAN)


@dataclass(frozen=True)
class PushBuffers:
    """One rank's receive region and next slots (see the module docstring).

    recv: int32 [RECV_SLOTS, world, max_rows, row_floats], this rank's own (symmetric
    memory on GPUs), every word SENTINEL at first. recv_bases: int64 [world] on the rank's
    device, every rank's recv as this rank addresses it (peer pointers). slots: int32
    [max_rows], zero at first."""

    recv: torch.Tensor
    recv_bases: torch.Tensor
    slots: torch.Tensor
    rank: int
    world: int
    max_rows: int
    row_floats: int

    def fits(self, rows: int, hidden: int) -> bool:
        """Whether `rows` rows of `hidden` go through the push kernel: the kernel's 16-byte
        stores need row_floats (and the cells) in whole groups of 4 words."""
        return 0 < rows <= self.max_rows and hidden <= self.row_floats and self.row_floats % 4 == 0


def recv_words(world: int, max_rows: int, row_floats: int) -> int:
    """int32 words of one rank's receive region."""
    return RECV_SLOTS * world * max_rows * row_floats


@triton.jit
def poll_cell(ptrs, mask, MAX_SPINS: tl.constexpr, TIMEOUT_NS: tl.constexpr):
    """The words at `ptrs` once none is SENTINEL (a peer wrote them), read volatile (not
    cached: a peer GPU writes them). MAX_SPINS 0: without bound but TIMEOUT_NS (the
    engine: stop_if_late); > 0 gives up after that many extra reads (tests), leaving
    SENTINEL words in what it returns."""
    got = tl.load(ptrs, mask=mask, other=0, volatile=True)
    missing = tl.sum((got == _SENTINEL).to(tl.int32), axis=0)
    if MAX_SPINS > 0:
        spins = 0
        while (missing > 0) & (spins < MAX_SPINS):
            got = tl.load(ptrs, mask=mask, other=0, volatile=True)
            missing = tl.sum((got == _SENTINEL).to(tl.int32), axis=0)
            spins += 1
    else:
        start = global_ns() if TIMEOUT_NS > 0 else 0
        while missing > 0:
            got = tl.load(ptrs, mask=mask, other=0, volatile=True)
            missing = tl.sum((got == _SENTINEL).to(tl.int32), axis=0)
            stop_if_late(start, TIMEOUT_NS)
    return got


@triton.jit
def push_and_sum(
    mine,
    cols,
    mask,
    recv_bases_ptr,
    rank,
    slot,
    row,
    row_floats,
    WORLD: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    MAX_SPINS: tl.constexpr,
    TIMEOUT_NS: tl.constexpr,
):
    """Steps 3-5 of a call for the columns `cols` of `row`: push this rank's float32
    partial `mine` into its cell of `slot` in every peer, poll this rank's cells for every
    peer's, free them, and return the float32 sum in rank order."""
    bits = mine.to(tl.int32, bitcast=True)
    bits = tl.where(bits == _SENTINEL, _CANONICAL_NAN, bits)
    # Push first (no deadlock: see the module docstring): this rank's cell in every peer.
    my_cell = ((slot * WORLD + rank) * MAX_ROWS + row).to(tl.int64) * row_floats
    for q in tl.static_range(WORLD):
        if q != rank:
            peer = tl.load(recv_bases_ptr + q).to(tl.pointer_type(tl.int32))
            # Regions start on 16 bytes and row_floats is a multiple of 4 (PushBuffers.fits):
            # whole 16-byte stores, not 4 words one by one (the address came from memory).
            tl.store(tl.multiple_of(peer + my_cell, 16) + cols, bits, mask=mask)
    own = tl.multiple_of(tl.load(recv_bases_ptr + rank).to(tl.pointer_type(tl.int32)), 16)
    acc = tl.zeros(mine.shape, dtype=tl.float32)
    for q in tl.static_range(WORLD):
        if q == rank:
            part = bits.to(tl.float32, bitcast=True)  # what the peers received
        else:
            cell = own + ((slot * WORLD + q) * MAX_ROWS + row).to(tl.int64) * row_floats + cols
            got = poll_cell(cell, mask, MAX_SPINS, TIMEOUT_NS)
            # Free the cell for this row's call SLOTS calls on; each thread resets what it read.
            tl.store(cell, tl.full(mine.shape, _SENTINEL, tl.int32), mask=mask)
            part = got.to(tl.float32, bitcast=True)
        if q == 0:
            acc = part  # rank 0's partial as it is: the same sum as the unfused p0 + p1
        else:
            acc = acc + part
    return acc


@triton.jit
def _tp_push_all_reduce_kernel(
    partial_ptr,  # float32 [rows, D]: this rank's partial (its site slice, local)
    recv_bases_ptr,  # int64 [WORLD]: every rank's receive region (int32 words)
    slot_ptr,  # int32 [MAX_ROWS]: this rank's next slot per row
    residual_ptr,  # ADD_NORM: the residual stream; else unused (out)
    weight_ptr,  # ADD_NORM: the norm's weight; else unused (out)
    out_ptr,  # the sum (activation dtype), or with ADD_NORM its norm
    residual_out_ptr,  # ADD_NORM: residual + sum; else unused (out)
    rank,
    D,
    eps,
    row_floats,
    out_row_stride,
    residual_row_stride,
    residual_out_row_stride,
    WORLD: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    SLOTS: tl.constexpr,
    ADD_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
    MAX_SPINS: tl.constexpr,  # 0 in the engine; tests bound the polls (poll_cell)
    TIMEOUT_NS: tl.constexpr,  # the engine's bound on GPUs (peer_timeout_ns)
):
    # The next kernel may launch now (it loads its weights while this one waits for the
    # peers); then wait for the GEMV that wrote this rank's partial.
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    # Volatile: the slot was stored by this row's previous call, an earlier kernel perhaps
    # on another SM, whose line an SM's L1 may still hold from before it. Then every warp
    # has read it before one thread stores the next: without the barrier a warp that
    # reaches its load late reads the next slot. Either way a rank pushes and polls the
    # wrong cells: wrong sums, or a poll no peer ever ends (both seen on 2 H200s).
    slot = tl.load(slot_ptr + row, volatile=True)
    tl.debug_barrier()
    tl.store(slot_ptr + row, (slot + 1) % SLOTS)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    mine = tl.load(partial_ptr + row.to(tl.int64) * D + cols, mask=mask, other=0.0)
    acc = push_and_sum(
        mine, cols, mask, recv_bases_ptr, rank, slot, row, row_floats,
        WORLD, MAX_ROWS, MAX_SPINS, TIMEOUT_NS,
    )  # fmt: skip
    store_reduced(
        acc,
        row,
        cols,
        mask,
        residual_ptr,
        weight_ptr,
        out_ptr,
        residual_out_ptr,
        D,
        eps,
        out_row_stride,
        residual_row_stride,
        residual_out_row_stride,
        ADD_NORM,
        UNIT_OFFSET,
        BLOCK_D,
        EMULATE_BF16,
    )


# Triton 3.6's interpreter truncates float32 -> bfloat16: see kernels.backend.cast_rtne.
_INTERPRETED = is_interpreted(_tp_push_all_reduce_kernel)


def _launch(
    sites: SiteBuffers,
    push: PushBuffers,
    site: int,
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
    check_site_call(sites, site, rows, hidden)
    if not push.fits(rows, hidden):
        raise ValueError(f"site {site} with {rows}x{hidden} does not fit the receive cells")
    block_d = triton.next_power_of_2(hidden)
    add_norm, residual, weight, residual_out = ending_operands(out, residual, weight, residual_out)
    pdl = programmatic_launch(out)
    with device_guard(out):
        _tp_push_all_reduce_kernel[(rows,)](
            sites.site_slice(site, rows, hidden),
            push.recv_bases,
            push.slots,
            residual,
            weight,
            out,
            residual_out,
            push.rank,
            hidden,
            float(eps),
            push.row_floats,
            out.stride(0),
            residual.stride(0),
            residual_out.stride(0),
            WORLD=push.world,
            MAX_ROWS=push.max_rows,
            SLOTS=RECV_SLOTS,
            ADD_NORM=add_norm,
            UNIT_OFFSET=unit_offset,
            BLOCK_D=block_d,
            EMULATE_BF16=_INTERPRETED,
            USE_PDL=pdl,
            MAX_SPINS=max_spins,
            TIMEOUT_NS=peer_timeout_ns(_INTERPRETED),
            num_warps=norm_num_warps(block_d),
            launch_pdl=pdl,
        )


def push_all_reduce(
    sites: SiteBuffers,
    push: PushBuffers,
    site: int,
    rows: int,
    hidden: int,
    dtype: torch.dtype,
    *,
    max_spins: int = 0,
) -> torch.Tensor:
    """`kernels.tp_all_reduce.site_all_reduce` by pushing: the rank-order sum of every
    rank's partial in `site`'s slice ([rows, hidden], written by the GEMV before this
    call), rounded to `dtype`, the same bits on every rank. `max_spins`: tests only."""
    out = torch.empty(rows, hidden, dtype=dtype, device=sites.data.device)
    _launch(sites, push, site, rows, hidden, out, None, None, None, 0.0, False, max_spins)
    return out


def push_all_reduce_add_rms_norm(
    sites: SiteBuffers,
    push: PushBuffers,
    site: int,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
    max_spins: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.add_rms_norm(sum, residual, weight, eps)` on what `push_all_reduce(...,
    residual.dtype)` returns, in one kernel: (normed, residual + sum)."""
    out, summed = norm_outputs(residual, weight, unit_offset)
    rows, hidden = residual.shape
    _launch(
        sites,
        push,
        site,
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
