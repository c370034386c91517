"""A TP rank reads and cuts its shard with few torch threads (engine.tensor_parallel.rank's
load_threads): at torch's default of one per core, each rank's small index ops waited on the
other ranks' and the read threads' cores (2x H100: a 70B TP=2 load 34.1 s at 32 threads on
rank 0, 21.2 s at 4). The process's own count comes back afterwards (rank 0 is the caller's
process: an API server goes on with its threads)."""

from __future__ import annotations

import os

import pytest
import torch

from engine.tensor_parallel.rank import LOAD_THREADS_MAX, load_threads


@pytest.mark.parametrize("world", [1, 2, 8])
def test_a_rank_loads_with_its_share_of_the_cores_and_gives_them_back(world: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, 2))
    start = torch.get_num_threads()
    try:
        with load_threads(world):
            inside = torch.get_num_threads()
        assert torch.get_num_threads() == start
    finally:
        torch.set_num_threads(before)
    share = max(1, (os.cpu_count() or 1) // world)
    assert inside == max(1, min(start, share, LOAD_THREADS_MAX))
    assert 1 <= inside <= LOAD_THREADS_MAX


def test_the_count_comes_back_when_the_load_fails() -> None:
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), load_threads(2):
        raise RuntimeError("a part could not be read")
    assert torch.get_num_threads() == before
