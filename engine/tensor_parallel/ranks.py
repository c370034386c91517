"""The other ranks of a tensor-parallel model, as rank 0's runner holds them, and how a
process leaves the group."""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist


@dataclass
class Ranks:
    """`world_size` ranks of one process group; this process is rank 0 on `device`.
    `workers`: the processes this one spawned for ranks 1.. (none under torchrun, whose
    ranks were `launched` by torchrun). `devices`: every rank's device, by rank.
    `memory`: what every rank held once loaded, by rank (rank.rank_memory)."""

    world_size: int
    device: torch.device
    devices: list[str]
    workers: list[BaseProcess] = field(default_factory=list)
    launched: bool = False
    memory: list[dict[str, int]] = field(default_factory=list)


def stop_workers(workers: list[BaseProcess]) -> None:
    """Terminate the spawned ranks still alive (no collective: they may be stuck in one)."""
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
            worker.join(timeout=10)


def leave_group(*, launched: bool) -> None:
    """Drop this process's group as it leaves tensor parallelism. Not for torchrun's ranks
    on NCCL: there both ranks hung inside destroy_process_group (2x H100, torch 2.11, the
    stacks of both taken after 70 s), and each process exits right after serving, which
    frees its communicator anyway."""
    if launched and dist.get_backend() == "nccl":
        return
    dist.destroy_process_group()
