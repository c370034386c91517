"""The decode all-reduces as Kestrel's own kernel (kernels/tp_all_reduce.py), one buffer
slice and flag set per row-parallel linear (a "site": o_proj and down_proj of each layer).

What it saves against torch's one-shot all-reduce (all_reduce.py), per site and token: the
cast kernel of the float32 sum back to the activation dtype, and with `add_rms_norm` the
residual add + RMSNorm kernel that follows; and the kernel takes part in programmatic
dependent launch, where torch's kernel and the cast broke the chain on both sides.

The GEMV writes its float32 partial straight into the site's slice (`staging`); then
`sum` (all-reduce + cast) or `add_rms_norm` (all-reduce + cast + residual add + norm).
A row-parallel linear whose result goes straight into the next norm's residual add
(engine/tensor_parallel/transform.py decides) hands its staged partial over with `defer`;
the norm (`ReducingRMSNorm`) finds it with `take` and runs the fused kernel. Deferred
partials are float32 and not yet summed: anything else that received one would compute
garbage, hence `defer` refuses while one is pending, and the transform defers only where
the layer's code is known (DecoderLayer.forward_residual).

Two kernels do the exchange: `flags` (kernels/tp_all_reduce.py: publish a flag into every
peer, wait for theirs, read their partials over NVLink) and `push` (kernels/
tp_push_all_reduce.py: store the partial into every peer's receive cell, poll only local
memory). Both sum in rank order and give the same bits. KESTREL_TP_SITE_KERNEL picks one
(default `push`: 3.1 against 7.5 µs per all-reduce on 2 H100s, and the whole multi-GPU
suite passes with it on 2 H200s; `flags` stays as the fallback to compare against).

Prompt rows (more than a site holds) at the same linears take two more slices in the
activation dtype (`build_prompt`, PROMPT_SLOTS): the product is copied in and the `flags`
kernel sums it, in place of NCCL's ring; where a decode row's sum is deferred into the next
norm, so is a prompt row's (fused_sites.py: the copy at the linear, the kernel with the
residual add and norm at the norm, nothing between them, so the slices' call order holds).

Set up once per rank, after the process group, at the same point on every rank (a
collective: symmetric memory). KESTREL_TP_FUSED=0 keeps torch's one-shot path (for
comparisons); KESTREL_TP_ALLREDUCE=nccl turns all of symmetric memory off.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.tensor_parallel.all_reduce import symmetric_empty
from kernels.tp_all_reduce import (
    MAX_FUSED_D,
    SiteBuffers,
    site_all_reduce,
    site_all_reduce_add_rms_norm,
)
from kernels.tp_push_all_reduce import (
    RECV_SLOTS,
    SENTINEL,
    PushBuffers,
    push_all_reduce,
    push_all_reduce_add_rms_norm,
    recv_words,
)

log = logging.getLogger(__name__)

# Per site, as much as torch's one-shot buffer holds (all_reduce.ONE_SHOT_MAX_BYTES): 16
# decode rows of an 8B model (hidden 4096), 8 of a 70B (8192); larger batches take the
# one-shot or NCCL path. 2 sites per layer: 16 MiB for 32 layers, 40 MiB for 80.
SITE_BYTES = 256 << 10
# Rows the flags and epochs are kept for (the most a site slice holds at hidden >= 1024).
MAX_SITE_ROWS = 64
# Prompt rows (a prefill chunk: more rows than a site holds) take the `flags` kernel over
# two slices in the activation dtype, the sites using them in turn (site % PROMPT_SLOTS):
# NCCL's ring took 35 us for an 8B's 512 x 4096 float16 sum on 2 H200s, 2.3 of a TP
# prefill's 13.1 ms (bench/results/multigpu/2026-11-29-2xh200-tp-8b-profiles-s28.json).
# Two slices keep kernels/tp_all_reduce.py's argument: a rank writes a slice again only
# after a call on the other slice has waited for every peer, whose kernel of the call
# before, the one that read the slice, has then completed. That needs consecutive prompt
# calls on alternate slices: the sites are numbered in module order, which is call order
# (as for the decode sites), and a forward has an even number of them (transform.py's
# _use_sites builds the slices only then), so a forward's last call and the next one's
# first differ too. Rows up to a default prefill chunk (more go to NCCL): 2 x 2048 x 8192 x
# 2 bytes = 64 MiB a rank for a 70B, 32 MiB for an 8B.
PROMPT_SLOTS = 2
PROMPT_MAX_ROWS = 2048


SITE_KERNELS = ("flags", "push")


def fused_enabled() -> bool:
    """Whether the site all-reduce is used (KESTREL_TP_FUSED=0: torch's one-shot path)."""
    return os.environ.get("KESTREL_TP_FUSED", "1") != "0"


def site_kernel(kernel: str | None = None) -> str:
    """`kernel` checked, or (None) the one KESTREL_TP_SITE_KERNEL names (`push` unless set)."""
    source = "site all-reduce kernel"
    if kernel is None:
        source, kernel = "KESTREL_TP_SITE_KERNEL", os.environ.get("KESTREL_TP_SITE_KERNEL", "push")
    if kernel not in SITE_KERNELS:
        raise ValueError(f"{source} {kernel!r}: expected one of {SITE_KERNELS}")
    return kernel


@dataclass
class _Pending:
    partial: torch.Tensor  # the site's staged float32 partial, as handed to the layer
    site: int


def sites_agreed(
    group: dist.ProcessGroup, device: torch.device, ok: bool, kernel: str | None
) -> bool:
    """Whether every rank of `group` got through its step of the set-up (`ok`), and the
    same answer on all of them. `kernel`: the one this rank runs (None: its
    KESTREL_TP_SITE_KERNEL was refused). Raises, on every rank alike, where the ranks name
    different kernels or one named none: a collective."""
    choice = SITE_KERNELS.index(kernel) if kernel is not None else -1
    votes = torch.tensor([int(ok), choice, -choice], dtype=torch.int64, device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    lowest, highest = int(votes[1]), -int(votes[2])
    if lowest < 0:
        raise ValueError(
            f"tensor parallel: a rank's KESTREL_TP_SITE_KERNEL is not one of {SITE_KERNELS}"
        )
    if lowest != highest:
        raise ValueError(
            f"tensor parallel: the ranks run different site all-reduce kernels "
            f"({SITE_KERNELS[lowest]!r} and {SITE_KERNELS[highest]!r}); set "
            "KESTREL_TP_SITE_KERNEL alike on every rank"
        )
    return bool(votes[0])


def _log_unavailable(problem: Exception | None, fallback: str) -> None:
    reason = (
        f"{type(problem).__name__}: {problem}" if problem else "a peer rank could not set it up"
    )
    log.warning(
        "tensor parallel: the fused site all-reduce is not available (%s); %s",
        reason,
        fallback,
    )


class SiteAllReduce:
    """One rank's site buffers over symmetric memory and the calls on them."""

    def __init__(self, sites: SiteBuffers, push: PushBuffers | None = None) -> None:
        """push: the receive region of the `push` kernel; None: the `flags` kernel."""
        self.buffers = sites
        self.push = push
        self._pending: _Pending | None = None

    @classmethod
    def build(
        cls,
        group: dist.ProcessGroup | None,
        device: torch.device,
        sites: int,
        hidden: int,
        kernel: str | None = None,
        *,
        enabled: bool = True,
        data_dtype: torch.dtype = torch.float32,
        max_rows: int | None = None,
    ) -> SiteAllReduce | None:
        """The rank's site buffers for `sites` sites of `hidden` outputs, or None where the
        kernel can't be used here or on a peer rank (logged): every rank gets buffers or
        every rank None. A collective: every rank calls it at one point, with the same
        `kernel` (`flags` or `push`; None: site_kernel()), or all of them raise.
        `data_dtype` and `max_rows`: the partials' dtype and the rows a site holds (default:
        float32 decode partials, as many rows as SITE_BYTES hold, at most MAX_SITE_ROWS)."""
        if hidden > MAX_FUSED_D or sites < 2:  # the same on every rank (one model)
            return None
        fallback = (
            "decode all-reduces use torch's one-shot kernel"
            if data_dtype == torch.float32
            else "prompt rows' all-reduces use NCCL"
        )
        try:
            kernel = site_kernel(kernel)
        except ValueError as error:
            refused: ValueError | None = error
        else:
            refused = None
        if max_rows is None:
            site_elements = SITE_BYTES // data_dtype.itemsize
            max_rows = min(MAX_SITE_ROWS, site_elements // hidden)
        else:
            site_elements = max_rows * hidden
        # The data region in float32 words, on 16 bytes (the flags follow it).
        data_words = -(-sites * site_elements * data_dtype.itemsize // 16) * 4
        world_group = group if group is not None else dist.group.WORLD
        assert world_group is not None
        # Each rank's own steps may fail where its peers' succeed (its environment, its
        # allocation, its view of the peers' addresses); after each, the ranks agree
        # (sites_agreed), so that all of them take the kernel or none does: a rank that
        # skipped a collective, or the kernel, would leave its peers waiting for good.
        problem: Exception | None = refused
        if problem is None and not enabled:
            problem = RuntimeError("KESTREL_TP_FUSED=0 on this rank")
        if problem is None:
            try:
                import torch.distributed._symmetric_memory as symm_mem

                world = dist.get_world_size(world_group)
                flag_ints = sites * world * max_rows
                recv_ints = recv_words(world, max_rows, hidden) if kernel == "push" else 0
                words = data_words + flag_ints + 4 + recv_ints
                buffer = symmetric_empty(words, torch.float32, device)
                # The receive region on a 16-byte boundary: the kernel stores 4 words at a time.
                flags_end = -(-(data_words + flag_ints) // 4) * 4
                # Zero the flags (and fill the receive cells with SENTINEL) before any peer can
                # write into them: the barrier below orders this before every peer's first
                # kernel (stream order).
                buffer[data_words:flags_end].view(torch.int32).zero_()
                recv = buffer[flags_end : flags_end + recv_ints].view(torch.int32)
                recv.fill_(SENTINEL)
            except Exception as error:  # no symmetric memory in this torch, no room
                problem = error
        try:
            agreed = sites_agreed(
                world_group, device, problem is None, kernel if refused is None else None
            )
        except ValueError as disagreement:
            # Every rank raises; the one whose own setting was refused says what it was.
            raise (refused or disagreement) from (disagreement if refused else None)
        if not agreed:
            if enabled:
                _log_unavailable(problem, fallback)
            else:
                log.info("tensor parallel: the fused site all-reduce is off (KESTREL_TP_FUSED=0)")
            return None
        # A rendezvous that fails on one rank after its peers entered it leaves them in it
        # (torch's own collective): only failures after it returns everywhere are agreed on.
        try:
            handle = symm_mem.rendezvous(buffer, world_group.group_name)
            # buffer_ptrs are the allocations' bases; the tensor may start inside one.
            offset = buffer.data_ptr() - handle.buffer_ptrs[handle.rank]
            data_bases = torch.tensor(
                [p + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=device
            )
            # The kernels take every region to start on 16 bytes (their vector accesses).
            if any(int(base) % 16 for base in data_bases.tolist()):
                raise ValueError(f"symmetric buffers not 16-byte aligned: {data_bases.tolist()}")
        except Exception as error:  # no P2P between these GPUs
            problem = error
        if not sites_agreed(world_group, device, problem is None, kernel):
            _log_unavailable(problem, fallback)
            return None
        handle.barrier()
        push = None
        if kernel == "push":
            push = PushBuffers(
                recv=recv.view(RECV_SLOTS, handle.world_size, max_rows, hidden),
                recv_bases=data_bases + flags_end * 4,
                slots=torch.zeros(max_rows, dtype=torch.int32, device=device),
                rank=handle.rank,
                world=handle.world_size,
                max_rows=max_rows,
                row_floats=hidden,
            )
        return cls(
            SiteBuffers(
                data=buffer[:data_words].view(data_dtype)[: sites * site_elements],
                data_bases=data_bases,
                flag_bases=data_bases + data_words * 4,
                epochs=torch.zeros(sites, max_rows, dtype=torch.int32, device=device),
                rank=handle.rank,
                world=handle.world_size,
                sites=sites,
                site_elements=site_elements,
                max_rows=max_rows,
            ),
            push,
        )

    @classmethod
    def build_prompt(
        cls,
        group: dist.ProcessGroup | None,
        device: torch.device,
        hidden: int,
        dtype: torch.dtype,
        *,
        enabled: bool = True,
    ) -> SiteAllReduce | None:
        """The prompt rows' all-reduce (see PROMPT_SLOTS): PROMPT_SLOTS slices of
        PROMPT_MAX_ROWS x `hidden` partials in `dtype` (the activations'), the `flags`
        kernel. A collective, as `build`."""
        if dtype not in (torch.float16, torch.bfloat16):
            return None  # the same on every rank (one model)
        return cls.build(
            group,
            device,
            PROMPT_SLOTS,
            hidden,
            "flags",
            enabled=enabled,
            data_dtype=dtype,
            max_rows=PROMPT_MAX_ROWS,
        )

    def staging(self, site: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The site's slice (float32, or the prompt slices' dtype) viewed as `shape`
        ([..., hidden]) for the partial, or None where these rows don't fit (the caller takes
        another path)."""
        hidden = shape[-1]
        rows = math.prod(shape[:-1])
        if not self.buffers.fits(rows, hidden):
            return None
        if self.push is not None and not self.push.fits(rows, hidden):
            return None
        return self.buffers.site_slice(site, rows, hidden).view(shape)

    def sum(self, site: int, staged: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The sum over the ranks of the site's partials, in `dtype`, shaped as `staged`."""
        hidden = staged.shape[-1]
        rows = staged.numel() // hidden
        if self.push is not None:
            summed = push_all_reduce(self.buffers, self.push, site, rows, hidden, dtype)
        else:
            summed = site_all_reduce(self.buffers, site, rows, hidden, dtype)
        return summed.view(staged.shape)

    def defer(self, site: int, staged: torch.Tensor) -> torch.Tensor:
        """Hand `staged` (the site's partial, not yet summed) to the layer, for the next
        norm to sum with `take` + `add_rms_norm`."""
        if self._pending is not None:
            raise RuntimeError(
                f"tensor parallel: the partial of site {self._pending.site} was never summed "
                "(a deferred all-reduce reached something other than its norm)"
            )
        self._pending = _Pending(staged, site)
        return staged

    @property
    def pending(self) -> bool:
        """Whether a deferred partial waits for its norm."""
        return self._pending is not None

    def take(self, x: torch.Tensor) -> int | None:
        """The site whose deferred partial `x` is (and it is no longer pending), else None."""
        pending = self._pending
        if pending is None or pending.partial is not x:
            return None
        self._pending = None
        return pending.site

    def add_rms_norm(
        self,
        site: int,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        unit_offset: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + sum), residual + sum) for the site's sum, as
        kernels.add_rms_norm computes it on the sum rounded to residual's dtype."""
        shape = residual.shape
        rows = residual.reshape(-1, shape[-1])
        if self.push is not None:
            normed, summed = push_all_reduce_add_rms_norm(
                self.buffers, self.push, site, rows, weight, eps, unit_offset=unit_offset
            )
        else:
            normed, summed = site_all_reduce_add_rms_norm(
                self.buffers, site, rows, weight, eps, unit_offset=unit_offset
            )
        return normed.view(shape), summed.view(shape)
