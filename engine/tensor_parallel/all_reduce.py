"""The sum of the ranks' partial outputs after each row-parallel linear (two per layer).

At batch-1 decode these messages are small (one row of the hidden size, 16 KiB for an 8B
model in float32) and there are two per layer, so their latency, not their bandwidth, is
what tensor parallelism pays: NCCL's ring took ~20 µs each inside the decode graph on
2x H100 (8B: 64 per token, more than the half of the weights a rank no longer reads).

On CUDA, messages up to ONE_SHOT_MAX_BYTES go through torch's symmetric memory instead: each
rank copies its partial into a buffer every rank can read over NVLink, and one kernel
(torch.ops.symm_mem.one_shot_all_reduce_out) reads all peers' buffers and sums them, with
the barriers it needs on both sides. It needs peer access between the GPUs and is set up
once per rank after the process group (a collective: every rank builds it at the same
point of its start-up). When symmetric memory is not available (no P2P, an older torch,
KESTREL_TP_ALLREDUCE=nccl) or a message is larger, NCCL's all_reduce does it; on the CPU,
gloo's.

Every rank sums the same partials in the same rank order in either path, so all ranks hold
the same bits afterwards.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import threading

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Larger messages (prefill, big decode batches) are bandwidth-bound: NCCL's two-step
# algorithms move fewer bytes per rank than a one-shot read of every peer's whole buffer.
ONE_SHOT_MAX_BYTES = 256 << 10

# What the symmetric-memory set-up imports on first use (symmetric_empty keeps sympy out of
# it). preimport_symmetric_memory starts that in a thread where the rank would otherwise
# wait (for its spec, for the other ranks, in the group's rendezvous), never beside the
# weight reads: while a thread imports, every torch call of the reading thread gives up the
# GIL and waits for it again behind the import (a torch op releases it; the importer only
# yields it every switch interval), so the reads and cuts all but stop for the whole import.
# On the CPU, 3000 small torch ops took 0.23 s beside a 0.22 s import of sympy instead of
# 0.013 alone; on 2x H100 the cut plan, the first torch work of a rank's read, took 1.4-2.7 s
# beside that import where the CPU needs 0.1 (issue 33).
_SYMMETRIC_MEMORY_IMPORTS = ("torch.distributed._symmetric_memory",)
_preimport: threading.Thread | None = None


# Whether this process has set up symmetric memory for a TP launch. Rank 0 is the caller's
# own process and outlives a TP model; on 2x H100 (torch 2.11) its second launch hung in
# symmetric memory's rendezvous, every rank waiting for the others, whether the launch
# registered under the default group's name or under a name of its own (the spawned ranks
# are new processes each time). So a process sets it up once; its later launches (unload,
# then load again in the same process) use NCCL for these messages, a few per cent slower
# at batch-1 decode. torchrun's ranks launch once and are not affected.
_symmetric_memory_set_up = False


def _uses_symmetric_memory(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("KESTREL_TP_ALLREDUCE") != "nccl"


def every_rank(group: dist.ProcessGroup | None, device: torch.device, ok: bool) -> bool:
    """Whether `ok` holds on every rank of `group`, the same answer on all of them: where a
    rank's own step of a set-up may fail while its peers' succeed, they agree this way on
    one path (a rank alone on a path would wait for good on a collective or a kernel its
    peers never run). A collective; `device` holds the vote (CUDA for NCCL)."""
    vote = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group)
    return bool(vote.item())


def symmetric_memory_agreed(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether every rank of the launch may set up symmetric memory: the new ranks always
    may, rank 0 (the caller's process) only on its first launch, and all of them must take
    the same path or the set-up's rendezvous would wait forever. A collective."""
    return every_rank(group, device, not _symmetric_memory_set_up)


def note_symmetric_memory_set_up() -> None:
    """Record that this process has set up symmetric memory for a TP launch."""
    global _symmetric_memory_set_up
    _symmetric_memory_set_up = True


def preimport_symmetric_memory(device: torch.device) -> None:
    """Import what the symmetric-memory all-reduce needs, in a background thread (a rank on
    a GPU; nothing elsewhere). GroupAllReduce waits for it. An import that fails here fails
    again, with its message, where the set-up imports it."""
    global _preimport
    if _preimport is not None or not _uses_symmetric_memory(device):
        return

    def run() -> None:
        for name in _SYMMETRIC_MEMORY_IMPORTS:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - reported by the set-up's own import
                return

    _preimport = threading.Thread(target=run, name="kestrel-symm-mem-import", daemon=True)
    _preimport.start()


def finish_symmetric_memory_imports(device: torch.device) -> None:
    """Import what the symmetric-memory set-up needs now, or wait for the thread
    preimport_symmetric_memory started (nothing where it is not used)."""
    preimport_symmetric_memory(device)
    if _preimport is not None:
        _preimport.join()


def symmetric_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of `numel` elements in symmetric memory, for a rendezvous.

    Not torch's `symm_mem.empty`: in torch 2.11 it allocates from an implicit pool whose set-up
    computes strides through torch._prims_common, and that call's first use imports torch.fx's
    symbolic shapes and sympy (1.5-2.0 s of rank 0's critical path in a 70B TP=2 load on
    2x H100, after its reads, issue 33). A 1-D tensor's stride is (1,), so this asks the
    allocator directly; where that entry point is missing or refuses, torch's own `empty`."""
    import torch.distributed._symmetric_memory as symm_mem

    try:
        from torch._C._distributed_c10d import _SymmetricMemory

        return _SymmetricMemory.empty_strided_p2p((numel,), (1,), dtype, device)
    except (ImportError, AttributeError, TypeError, RuntimeError) as error:
        log.info("symmetric memory: direct allocation refused (%s); using symm_mem.empty", error)
        return symm_mem.empty(numel, dtype=dtype, device=device)


class GroupAllReduce:
    """Sums tensors over a process group; built once per rank, shared by its linears."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group
        self.buffer: torch.Tensor | None = None
        self.group_name = ""
        if not _uses_symmetric_memory(device):
            return
        if not symmetric_memory_agreed(group, device):
            log.warning(
                "tensor parallel: this process set up symmetric memory for an earlier TP "
                "launch and cannot do it again; small all-reduces use NCCL (start a new "
                "process for the faster path)"
            )
            return
        if _preimport is not None:
            _preimport.join()
        problem: Exception | None = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            world = group if group is not None else dist.group.WORLD
            assert world is not None
            name = world.group_name
            buffer = symmetric_empty(ONE_SHOT_MAX_BYTES // 4, torch.float32, device)
            symm_mem.rendezvous(buffer, name)
        except Exception as error:  # no P2P between the GPUs, no symmetric memory in torch
            problem = error
        # One rank on the one-shot path and another on NCCL would wait on each other.
        if not every_rank(group, device, problem is None):
            log.warning(
                "tensor parallel: one-shot all-reduce over symmetric memory is not available "
                "(%s); small all-reduces use NCCL",
                f"{type(problem).__name__}: {problem}" if problem else "not on a peer rank",
            )
            return
        note_symmetric_memory_set_up()
        self.buffer, self.group_name = buffer, name

    @property
    def one_shot(self) -> bool:
        """Whether small float32 messages take the symmetric-memory path."""
        return self.buffer is not None

    def staging(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A float32 view of `shape` on the peer-readable buffer, for a kernel to write its
        partial into directly (then `sum_staged`: no copy kernel), or None when such a
        message does not take the one-shot path."""
        buffer = self.buffer
        numel = math.prod(shape)
        if buffer is None or numel > buffer.numel():
            return None
        return buffer[:numel].view(shape)

    def sum_staged(self, staged: torch.Tensor) -> torch.Tensor:
        """The sum over the group of the `staging` views every rank has written: a new
        tensor. The one-shot kernel's barriers keep a rank from writing the buffer again
        before every peer has read it."""
        out = torch.empty_like(staged)
        torch.ops.symm_mem.one_shot_all_reduce_out(
            staged.view(-1), "sum", self.group_name, out.view(-1)
        )
        return out

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """The sum of `y` (contiguous) over the group: a new tensor, or `y` summed in place."""
        staged = self.staging(tuple(y.shape)) if y.dtype == torch.float32 else None
        if staged is not None:
            staged.copy_(y)
            return self.sum_staged(staged)
        dist.all_reduce(y, group=self.group)
        return y
