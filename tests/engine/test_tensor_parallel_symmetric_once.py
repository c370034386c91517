"""A process sets up symmetric memory for one TP launch only, and every rank of a launch
takes the same path (issue 33).

On 2x H100 (torch 2.11) a second TP launch from one process (unload, then load again: the
web UI's Load button, test_multigpu.py's second TP case) hung in symmetric memory's
rendezvous. Rank 0 is that process; the other ranks are new each launch. So rank 0's later
launches use NCCL for the small all-reduces, and the new ranks must follow it: a rank that
tried the rendezvous alone would wait forever. Here two gloo ranks on the CPU decide."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.tensor_parallel import all_reduce
from helpers.gloo_ranks import run_gloo_ranks

WORLD = 2


def _launches(rank: int) -> tuple[bool, bool]:
    cpu = torch.device("cpu")
    first = all_reduce.symmetric_memory_agreed(None, cpu)
    if rank == 0:  # rank 0's first launch set it up; the new ranks never did
        all_reduce.note_symmetric_memory_set_up()
    second = all_reduce.symmetric_memory_agreed(None, cpu)
    return first, second


def test_a_later_launch_of_the_same_process_uses_nccl_on_every_rank(tmp_path: Path) -> None:
    decided = run_gloo_ranks(_launches, tmp_path, WORLD)
    assert decided == [(True, False), (True, False)]
