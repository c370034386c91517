"""Unloading a tensor-parallel model (issue 33, engine/tensor_parallel/leave.py).

On 2x H100 every 70B TP=2 unload took 60 s: the spawned rank left the group while its
serving function still held its decode graphs, and NCCL's destroy waits for the graphs
that captured its collectives, while rank 0 waited 60 s for that process to end before it
killed it and left the group itself. Now every rank lets go of its graphs (each captured
CUDA graph destroyed) and its shard, the ranks meet, leave the group together, and the
spawned ranks end by themselves.

Gloo on the CPU has no such wait, so these tests check the mechanism, never a time: what
each rank reported it let go of at the meeting (the graphs it held gone, not just
cleared), that no rank had to be terminated, and that the processes exited cleanly."""

from __future__ import annotations

import random
import weakref
from pathlib import Path

import pytest

from engine.engine import EngineOptions
from engine.tensor_parallel.launch import launch_tensor_parallel
from engine.tensor_parallel.runner import TensorParallelRunner
from helpers.mixed_model import build_mixed_model

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ban_eos_token": True}


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mixed_model(tmp_path_factory.mktemp("tp_unload"))


def _options() -> EngineOptions:
    return EngineOptions(
        device="cpu", dtype="float32", max_seq_len=256, page_size=8, cache_tokens=512
    )


@pytest.mark.parametrize("with_graphs", [True, False], ids=["graphs", "eager"])
def test_every_rank_lets_go_of_its_graphs_and_the_ranks_end_by_themselves(
    mixed_model: Path, with_graphs: bool
) -> None:
    tp = launch_tensor_parallel(mixed_model, _options(), 2)
    runner = tp.runner
    assert isinstance(runner, TensorParallelRunner)
    ranks = runner.ranks
    workers = list(ranks.workers)
    held = None
    if with_graphs:
        # Made on every rank; a prompt and decode steps then make graphs on every rank (the
        # static buffers run eagerly on the CPU, the path captured graphs take on a GPU).
        held = weakref.ref(tp.enable_decode_graphs(capture=False))
    prompt = [random.Random(1).randrange(3, 384) for _ in range(40)]
    job = tp.scheduler.submit(prompt, GREEDY)
    assert len([t for e in tp.scheduler.stream_many([job]) for t in e.token_ids]) == 4
    tp.unload()

    assert all(not w.is_alive() for w in workers)
    # Both ranks came to the meeting before leaving the group, each with its graphs
    # released and gone: a rank > 0 keeping them past its serving loop (its locals) would
    # report them alive, and on NCCL would wait in the destroy.
    assert len(ranks.left) == 2, ranks.left
    for rank, report in enumerate(ranks.left):
        assert report["graphs_alive"] == 0, (rank, report)
        assert report["graphs_reset"] == 0  # nothing is captured on the CPU
        if with_graphs:
            assert report["graphs_dropped"] >= 2, (rank, report)  # the prompt's, a decode's
        else:
            assert report["graphs_dropped"] == 0
    # Nothing had to be killed: each spawned rank ended by itself, cleanly, after leaving
    # (a rank left waiting at the meeting, or in the destroy, would be terminated: -15).
    assert ranks.terminated == []
    assert [w.exitcode for w in workers] == [0]
    if held is not None:
        assert held() is None  # rank 0's graphs are gone too
