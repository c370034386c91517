"""Ranks of a gloo process group on the CPU, one process each: what tensor-parallel ranks
must agree on (a vote, a set-up that fails on one of them) is decided by real collectives,
not by one process standing in for all."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(
    rank: int, work: Callable[[int], Any], tmp: str, world: int, timeout_s: float, results: Any
) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(tmp) / 'store'}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        results[rank] = work(rank)
    finally:
        dist.destroy_process_group()


def run_gloo_ranks(
    work: Callable[[int], Any], tmp_path: Path, world: int = 2, *, timeout_s: float = 60.0
) -> list[Any]:
    """`work(rank)` in `world` spawned processes joined in one gloo group (a module-level
    function: it is pickled), their answers in rank order. A collective that a rank never
    joins fails after `timeout_s` rather than hang the suite."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(
            _entry, args=(work, str(tmp_path), world, timeout_s, results), nprocs=world, join=True
        )
        return [results[rank] for rank in range(world)]
