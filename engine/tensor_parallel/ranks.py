"""The other ranks of a tensor-parallel model, as rank 0's runner holds them."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue

import torch

from engine.tensor_parallel.protocol import Channel


@dataclass
class Ranks:
    """`world_size` ranks of one process group; this process is rank 0 on `device`.
    `workers`: the processes this one spawned for ranks 1.. (none under torchrun, whose
    ranks were `launched` by torchrun). `devices`: every rank's device, by rank.
    `memory`: what every rank held once loaded, by rank (rank.rank_memory); `load_phases`:
    how long each step of each rank's load took (load_phases.py). `channel`:
    what rank 0 sends its steps over (protocol.py). `reports`: where the spawned ranks
    write the error of a step that failed on them."""

    world_size: int
    device: torch.device
    devices: list[str]
    channel: Channel
    workers: list[BaseProcess] = field(default_factory=list)
    reports: Queue[tuple[int, str | None]] | None = None
    launched: bool = False
    memory: list[dict[str, int]] = field(default_factory=list)
    # Where each rank's load time went, by rank (load_phases.py).
    load_phases: list[dict[str, object]] = field(default_factory=list)
    # How the ranks left at unload (leave.py), by rank: what each let go of; empty when
    # they did not meet (a rank had stopped, or did not come in time).
    left: list[dict[str, int]] = field(default_factory=list)
    # The spawned ranks (1..) that unload had to terminate: they had not ended by
    # themselves once the group was gone.
    terminated: list[int] = field(default_factory=list)

    def failures(self) -> str:
        """What is known of ranks that stopped: the errors the spawned ranks reported and
        their exit codes ('' when none is known; torchrun's ranks report to its log)."""
        known = []
        if self.reports is not None:
            while True:
                try:
                    rank, error = self.reports.get(timeout=0.5)
                except (queue.Empty, OSError, ValueError):
                    break
                if error is not None:
                    known.append(f"rank {rank} failed: {error}")
        for rank, worker in enumerate(self.workers, start=1):
            worker.join(timeout=1.0)  # one that failed is on its way out
            if not worker.is_alive() and worker.exitcode not in (None, 0):
                known.append(f"rank {rank} exited with code {worker.exitcode}")
        return "; ".join(known)


def stop_workers(workers: list[BaseProcess]) -> None:
    """Terminate the spawned ranks still alive (no collective: they may be stuck in one)."""
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
            worker.join(timeout=10)
