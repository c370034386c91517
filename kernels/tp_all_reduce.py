"""The decode all-reduce of tensor parallelism as one Kestrel kernel, optionally fused with
the residual add + RMSNorm that follows it.

Every rank holds one buffer that every rank can address (torch's symmetric memory over
NVLink on GPUs; plain CPU tensors in the tests), laid out as `SiteBuffers` says:

    data:  [sites, site_elements]         one slice per all-reduce site (each o_proj and
                                          down_proj of each layer: 2 per layer), float32
                                          for the decode GEMVs' partials; for prompt rows
                                          two slices in the activation dtype, the sites
                                          taking them in turn (`site % 2`: PROMPT_SLOTS)
    flags: [sites, world, max_rows] int32 flags[s, q, row]: rank q's partial of site s is
                                          complete up to its call number flags[s, q, row]
and, local to each rank, `epochs` [sites, max_rows] int32: how many calls of site s
(with at least row+1 rows) this rank has made, counted by the kernel itself in device
memory, so a CUDA graph replays the same launches with advancing epochs.

A call at site s (one program per row): the GEMV has written this rank's float32 partial
into data[s] (quant_matmul(..., out=slice)); the kernel then
  1. waits for the previous kernel (PDL: the partial is complete and visible),
  2. takes epoch e = epochs[s, row] + 1 and stores it back,
  3. publishes flags[s, rank, row] = e into every rank's flags (release, system scope),
  4. waits until its own flags[s, q, row] == e for every peer q (acquire, system scope),
  5. sums every rank's row of data[s] in rank order (rank 0's partial + rank 1's + ...),
     so every rank computes the same float32 operations and holds the same bits,
  6. rounds the sum to the activation dtype (the unfused path's `.to(x.dtype)`) and
     either stores it, or (ADD_NORM) adds the residual, rounds, stores that as the new
     residual and its RMSNorm as the output: `kernels.add_rms_norm` on the rounded sum,
     with the same norm code (rms_norm_row, a fixed pairwise sum), hence the same bits.

Why no rank overwrites a slice a peer still reads. Both ranks make the same calls in the
same order (the same model on the same batches), and every forward calls every site (all
sites take this path or none: same rows, same hidden size). Rank r writes slice s again
(the GEMV of call (s, t+1)) only after its kernel of some later call (s', c) between
(s, t) and (s, t+1) has completed (there is one: a forward has at least two sites), and
that kernel waited for peer q's flag of (s', c). Peer q publishes that flag in its own
kernel of (s', c), after its PDL wait, so after q's kernel of (s, t), which read r's slice
s, has completed. Release/acquire at system scope order q's reads before r's new writes.
Flags never need resetting: only rank q writes flags[., q, .], with increasing epochs,
and q cannot publish call (s, t+1) before every rank has finished (s, t) by the same
argument, so `== e` never misses a value.

Why it cannot deadlock. A kernel publishes its own flag before it waits, and waits only
for the peers' flags of the same call. By induction over the common call sequence: if
every rank has completed the calls before c, every rank reaches call c, publishes, and
so every wait of call c ends. A waiting program waits for the peer's program of the same
row only; whatever it waits for runs on another GPU. With PDL the next kernel launches
only once every program of this one has started (launch_dependents), so the programs
this kernel waits on are never kept from running by its successors. A prompt's call has
more rows (up to site_reduce.PROMPT_MAX_ROWS) than a GPU may hold programs at once: then
progress rests on each GPU starting a grid's programs in increasing order, as NVIDIA GPUs
do (the lowest row not yet done is then running on every rank); a rank that waits past
KESTREL_TP_PEER_TIMEOUT_S stops its GPU with an error rather than hang.

Not for CPU/gloo runs: the engine uses it only on CUDA with symmetric memory; on the CPU
it runs under TRITON_INTERPRET=1 for the tests, which simulate the ranks in one process.
"""

from __future__ import annotations

import os
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
from kernels.rms_norm import MAX_SINGLE_PASS_D, norm_num_warps, rms_norm_row

# Rows held in registers as the norm kernel holds them (one program per row, single pass).
MAX_FUSED_D = MAX_SINGLE_PASS_D


@dataclass(frozen=True)
class SiteBuffers:
    """One rank's view of the all-reduce sites (see the module docstring).

    data_bases / flag_bases: int64 [world] on the rank's device, every rank's data and flag
    region as this rank addresses it (peer pointers). epochs: int32 [sites, max_rows], this
    rank's own, zero at first. `data` is this rank's data region as a tensor (float32, or
    float16/bfloat16 for prompt rows): the partials are written into its slices
    (`site_slice`), `site_elements` of data's dtype each."""

    data: torch.Tensor
    data_bases: torch.Tensor
    flag_bases: torch.Tensor
    epochs: torch.Tensor
    rank: int
    world: int
    sites: int
    site_elements: int
    max_rows: int

    def site_slice(self, site: int, rows: int, hidden: int) -> torch.Tensor:
        """This rank's [rows, hidden] slice of `site` (data's dtype) for the partial."""
        start = site * self.site_elements
        return self.data[start : start + rows * hidden].view(rows, hidden)

    def fits(self, rows: int, hidden: int) -> bool:
        return 0 < rows <= self.max_rows and rows * hidden <= self.site_elements


# How long the engine's all-reduce waits for a peer before it stops its GPU with an error.
# A peer that will never come (its process died, its host raised, it took another path)
# would otherwise keep this GPU spinning until the process is killed: no error, no exit.
# A healthy peer is microseconds behind, or seconds where its host compiles a kernel the
# first time; two minutes is neither. KESTREL_TP_PEER_TIMEOUT_S sets another bound (0: none,
# for a rank held in a debugger).
PEER_TIMEOUT_S = 120.0
PEER_LATE_MESSAGE = (
    "tensor parallel: a decode all-reduce waited longer than KESTREL_TP_PEER_TIMEOUT_S "
    "for a peer rank; stopping this GPU (a peer rank died or stopped calling the all-reduce)"
)
_PEER_LATE_MESSAGE: tl.constexpr = tl.constexpr(PEER_LATE_MESSAGE)


def peer_timeout_ns(interpreted: bool) -> int:
    """The kernels' TIMEOUT_NS: KESTREL_TP_PEER_TIMEOUT_S (default PEER_TIMEOUT_S) on GPUs;
    0 (no timer) in the interpreter, which has no %globaltimer (its tests bound the waits
    with MAX_SPINS instead)."""
    if interpreted:
        return 0
    value = os.environ.get("KESTREL_TP_PEER_TIMEOUT_S", str(PEER_TIMEOUT_S))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        raise ValueError(
            f"KESTREL_TP_PEER_TIMEOUT_S={value!r}: expected seconds >= 0 (0: no bound)"
        )
    return int(seconds * 1e9)


@triton.jit
def global_ns():
    """The GPU's nanosecond clock (%globaltimer), the same on every SM."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def stop_if_late(start_ns, TIMEOUT_NS: tl.constexpr):
    """Stop the GPU (trap: the process's next CUDA call raises) once TIMEOUT_NS have gone
    by since start_ns, saying why first. TIMEOUT_NS 0: never (no timer read)."""
    if TIMEOUT_NS > 0:
        if global_ns() - start_ns > TIMEOUT_NS:
            # One line per program, not one per thread (every thread traps).
            thread = tl.inline_asm_elementwise(
                "mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1
            )
            if thread == 0:
                tl.device_print(_PEER_LATE_MESSAGE)
            tl.inline_asm_elementwise(
                "trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
            )


@triton.jit
def wait_flag(flag_ptr, expected, MAX_SPINS: tl.constexpr, TIMEOUT_NS: tl.constexpr):
    """Spin until *flag_ptr == expected, reading it with acquire semantics at system scope
    (a peer GPU writes it). MAX_SPINS 0: without bound but TIMEOUT_NS (the engine:
    stop_if_late); > 0 gives up after that many reads (tests). Returns whether the flag
    arrived."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if MAX_SPINS > 0:
        spins = 0
        while (seen != expected) & (spins < MAX_SPINS):
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            spins += 1
    else:
        start = global_ns() if TIMEOUT_NS > 0 else 0
        while seen != expected:
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            stop_if_late(start, TIMEOUT_NS)
    return seen == expected


@triton.jit
def store_reduced(
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
    ADD_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """The end of a site all-reduce, for one row: the float32 rank-order sum `acc` rounded to
    the activation dtype (the unfused path's `.to(x.dtype)`) and stored, or (ADD_NORM) added
    to the residual, rounded, stored as the new residual, and its RMSNorm stored as the
    output, with `kernels.add_rms_norm`'s norm code (rms_norm_row), hence the same bits."""
    out_row = out_ptr + row.to(tl.int64) * out_row_stride
    if ADD_NORM:
        x_dtype = residual_ptr.dtype.element_ty
        x = cast_rtne(acc, x_dtype, EMULATE_BF16).to(tl.float32)
        r = tl.load(residual_ptr + row.to(tl.int64) * residual_row_stride + cols, mask=mask)
        summed = cast_rtne(x + r.to(tl.float32), x_dtype, EMULATE_BF16)
        tl.store(
            residual_out_ptr + row.to(tl.int64) * residual_out_row_stride + cols,
            summed,
            mask=mask,
        )
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = rms_norm_row(
            summed.to(tl.float32), w, D, eps, x_dtype, UNIT_OFFSET, EMULATE_BF16, BLOCK_D
        )
        tl.store(out_row + cols, cast_rtne(out, out_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)
    else:
        tl.store(out_row + cols, cast_rtne(acc, out_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


@triton.jit
def _tp_all_reduce_kernel(
    data_bases_ptr,  # int64 [WORLD]: every rank's data region (DATA_KIND's dtype)
    flag_bases_ptr,  # int64 [WORLD]: every rank's flags (int32)
    epoch_ptr,  # int32 [sites, MAX_ROWS]: this rank's call counts
    residual_ptr,  # ADD_NORM: the residual stream; else unused (out)
    weight_ptr,  # ADD_NORM: the norm's weight; else unused (out)
    out_ptr,  # the sum (activation dtype), or with ADD_NORM its norm
    residual_out_ptr,  # ADD_NORM: residual + sum; else unused (out)
    site,
    rank,
    D,
    eps,
    site_offset,  # site * site_elements: where the site's slice starts in each data region
    out_row_stride,
    residual_row_stride,
    residual_out_row_stride,
    WORLD: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    ADD_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
    MAX_SPINS: tl.constexpr,  # 0 in the engine; tests bound the waits (wait_flag)
    TIMEOUT_NS: tl.constexpr,  # the engine's bound on GPUs (peer_timeout_ns)
    DATA_KIND: tl.constexpr,  # the partials' dtype (DATA_KINDS): float32, float16, bfloat16
):
    # The next kernel may launch now (it loads its weights while this one waits for the
    # peers); then wait for the GEMV that wrote this rank's partial.
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    counter = epoch_ptr + site * MAX_ROWS + row
    # Volatile, then a barrier before the store, as the push kernel reads its slot (an
    # earlier kernel's store; a late warp would read the new count and wait for a flag no
    # peer publishes in this call).
    epoch = tl.load(counter, volatile=True) + 1
    tl.debug_barrier()
    tl.store(counter, epoch)
    # Publish before waiting (no deadlock: see the module docstring).
    mine = (site * WORLD + rank) * MAX_ROWS + row
    for q in tl.static_range(WORLD):
        flags = tl.load(flag_bases_ptr + q).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flags + mine, epoch, sem="release", scope="sys")
    own_flags = tl.load(flag_bases_ptr + rank).to(tl.pointer_type(tl.int32))
    for q in tl.static_range(WORLD):
        if q != rank:
            wait_flag(own_flags + (site * WORLD + q) * MAX_ROWS + row, epoch, MAX_SPINS, TIMEOUT_NS)
    # Every thread reads the peers' partials only after the wait above.
    tl.debug_barrier()

    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    offset = site_offset + row * D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for q in tl.static_range(WORLD):
        # Regions start on 16 bytes (SiteAllReduce.build checks): whole 16-byte loads where
        # the offset allows, not 4 floats one by one (the address came from memory).
        base = tl.load(data_bases_ptr + q)
        if DATA_KIND == 0:
            data = tl.multiple_of(base.to(tl.pointer_type(tl.float32)), 16)
        elif DATA_KIND == 1:
            data = tl.multiple_of(base.to(tl.pointer_type(tl.float16)), 16)
        else:
            data = tl.multiple_of(base.to(tl.pointer_type(tl.bfloat16)), 16)
        # .cv: fetched again each call, never an L1 copy of the previous call's partial.
        # Half-precision partials are summed in float32 too: two ranks' sum rounds once,
        # as NCCL's half-precision add does.
        part = tl.load(data + offset + cols, mask=mask, other=0.0, cache_modifier=".cv")
        part = part.to(tl.float32)
        if q == 0:
            acc = part  # rank 0's partial as it is: the same sum as the unfused p0 + p1
        else:
            acc = acc + part

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
_INTERPRETED = is_interpreted(_tp_all_reduce_kernel)


# The partials' dtypes the kernel reads (DATA_KIND is the index).
DATA_KINDS = (torch.float32, torch.float16, torch.bfloat16)


def check_site_call(sites: SiteBuffers, site: int, rows: int, hidden: int) -> None:
    """Refuse a call whose rows don't fit the site's slice or the kernel's one-pass rows."""
    if not 0 <= site < sites.sites or not sites.fits(rows, hidden):
        raise ValueError(f"site {site} with {rows}x{hidden} does not fit the site buffers")
    if hidden > MAX_FUSED_D:
        raise ValueError(f"rows of {hidden} > {MAX_FUSED_D} elements are not supported")


def ending_operands(
    out: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ADD_NORM, residual, weight, residual_out) for store_reduced: without a residual
    (the plain sum) the unused pointers are `out`."""
    if residual is None:
        return False, out, out, out
    assert weight is not None and residual_out is not None
    return True, residual, weight, residual_out


def norm_outputs(
    residual: torch.Tensor, weight: torch.Tensor, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked operands' outputs of a fused all-reduce + add + RMSNorm: (normed, new
    residual), as kernels.add_rms_norm types them. residual: [rows, hidden], unit stride."""
    rows, hidden = residual.shape
    if residual.stride(-1) != 1:
        raise ValueError("residual must have a unit last-dim stride")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    out_dtype = residual.dtype if unit_offset else torch.promote_types(residual.dtype, weight.dtype)
    out = torch.empty(rows, hidden, dtype=out_dtype, device=residual.device)
    summed = torch.empty(rows, hidden, dtype=residual.dtype, device=residual.device)
    return out, summed


def _launch(
    sites: SiteBuffers,
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
    block_d = triton.next_power_of_2(hidden)
    add_norm, residual, weight, residual_out = ending_operands(out, residual, weight, residual_out)
    pdl = programmatic_launch(out)
    with device_guard(out):
        _tp_all_reduce_kernel[(rows,)](
            sites.data_bases,
            sites.flag_bases,
            sites.epochs,
            residual,
            weight,
            out,
            residual_out,
            site,
            sites.rank,
            hidden,
            float(eps),
            site * sites.site_elements,
            out.stride(0),
            residual.stride(0),
            residual_out.stride(0),
            WORLD=sites.world,
            MAX_ROWS=sites.max_rows,
            ADD_NORM=add_norm,
            UNIT_OFFSET=unit_offset,
            BLOCK_D=block_d,
            EMULATE_BF16=_INTERPRETED,
            USE_PDL=pdl,
            MAX_SPINS=max_spins,
            TIMEOUT_NS=peer_timeout_ns(_INTERPRETED),
            DATA_KIND=DATA_KINDS.index(sites.data.dtype),
            num_warps=norm_num_warps(block_d),
            launch_pdl=pdl,
        )


def site_all_reduce(
    sites: SiteBuffers,
    site: int,
    rows: int,
    hidden: int,
    dtype: torch.dtype,
    *,
    max_spins: int = 0,
) -> torch.Tensor:
    """The sum over the ranks of every rank's partial in `site`'s slice ([rows, hidden],
    written by the GEMV before this call), rounded to `dtype`: a new [rows, hidden]
    tensor, the same bits on every rank. `max_spins`: tests only (wait_flag)."""
    out = torch.empty(rows, hidden, dtype=dtype, device=sites.data.device)
    _launch(sites, site, rows, hidden, out, None, None, None, 0.0, False, max_spins)
    return out


def site_all_reduce_add_rms_norm(
    sites: SiteBuffers,
    site: int,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
    max_spins: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.add_rms_norm(sum, residual, weight, eps)` where sum is what
    `site_all_reduce(..., residual.dtype)` returns, in one kernel: (normed, residual + sum).
    residual: [rows, hidden] with unit last-dim stride."""
    out, summed = norm_outputs(residual, weight, unit_offset)
    rows, hidden = residual.shape
    _launch(
        sites,
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
