"""Each TP launch registers its symmetric memory under a name of its own (issue 33).

torch names the default process group "0" in every launch and refuses to register symmetric
memory twice under one name, keeping the first launch's store. Rank 0 is the caller's own
process and outlives a TP model, so a second TP load in one process (unload, then load
again: the web UI's Load button, the multi-GPU test's second case) rendezvoused over the
first launch's store while the new rank used the new one, and both waited forever (seen on
2x H100). Here two gloo ranks on the CPU launch twice in the same processes."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from engine.tensor_parallel.all_reduce import launch_symmetric_group

WORLD = 2
LAUNCHES = 2


def _rank(rank: int, tmp: str, results: dict) -> None:
    names = []
    for launch in range(LAUNCHES):
        store_file = Path(tmp) / f"store-{launch}"
        dist.init_process_group(
            "gloo", init_method=f"file://{store_file}", rank=rank, world_size=WORLD
        )
        try:
            names.append(launch_symmetric_group(None))
        finally:
            dist.destroy_process_group()
    results[rank] = names


def test_every_launch_gets_its_own_symmetric_memory_name(tmp_path: Path) -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(str(tmp_path), results), nprocs=WORLD, join=True)
        by_rank = [list(results[rank]) for rank in range(WORLD)]
    first, second = by_rank[0]
    assert by_rank[1] == by_rank[0]  # every rank of a launch registers the same name
    assert first != second  # and a process's next launch a new one
    assert all(name.startswith("kestrel-tp-") for name in (first, second))
