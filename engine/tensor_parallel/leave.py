"""How the ranks of a tensor-parallel model leave it when rank 0 unloads (issue 33).

Rank 0 sends STOP; then every rank, at the same time:
1. lets go of its decode graphs (each captured CUDA graph destroyed: `DecodeGraphs.release`),
   its shard and its cache (`ServingRank.release`);
2. meets the others on the control group (`leave_group`), where each says what it let go
   of: past this point no rank sends anything on any group;
3. destroys the process group.
Rank 0 only then waits for the processes it spawned to end (runner.py).

Why in this order: NCCL's ncclCommDestroy waits until every CUDA graph that captured a
collective of the communicator is destroyed, and it may wait for the other ranks of the
machine to destroy theirs. A rank that left while its graphs were still held (worker_main
kept them in a local) waited there for ever, while rank 0 waited for that process to end
before leaving itself: every 70B TP=2 unload on 2x H100 took 60 s, the time rank 0 waited
before it killed the rank.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from engine.architectures.base import CausalLM
from engine.cache import PagedKVCache
from engine.cuda_graph import DecodeGraphs
from engine.tensor_parallel.protocol import Channel

# How long a rank waits at the meeting for the others (which only drop their graphs and
# shards first) before it leaves without them; rank 0 then ends the ranks still alive.
LEAVE_TIMEOUT_S = 30.0


@dataclass
class ServingRank:
    """What a rank > 0 holds while it serves: its shard, its cache and its decode graphs
    (made by rank 0's GRAPHS message when not at load). Held here, not in the serving
    function's locals, so that leaving can let go of all of it."""

    model: CausalLM | None
    cache: PagedKVCache | None
    graphs: DecodeGraphs | None = None

    def release(self) -> dict[str, int]:
        """Drop the graphs (destroying each captured one), the shard and the cache."""
        report = released_graphs(self)
        self.model = self.cache = None
        return report


def released_graphs(holder: object) -> dict[str, int]:
    """Take `holder.graphs` (a DecodeGraphs or None) from it, release them and say what
    became of them: DecodeGraphs.release's counts, and `graphs_alive`, 1 when the holder
    was the last reference but the graphs outlived their release (something else still
    holds them: a leak, though their CUDA graphs were destroyed)."""
    graphs: DecodeGraphs | None = getattr(holder, "graphs")  # noqa: B009
    if graphs is None:
        return {"graphs_dropped": 0, "graphs_reset": 0, "graphs_alive": 0}
    setattr(holder, "graphs", None)  # noqa: B010
    report = graphs.release()
    held = weakref.ref(graphs)
    del graphs
    gc.collect()  # a cycle through them would keep them until the next collection
    return {**report, "graphs_alive": int(held() is not None)}


def leave_group(
    channel: Channel, report: dict[str, int], timeout_s: float = LEAVE_TIMEOUT_S
) -> list[dict[str, int]] | None:
    """Every rank, after STOP and after letting go of its graphs and shard: meet the other
    ranks on the control group (bounded by `timeout_s`), exchange `report`s, then destroy
    the process group on every rank together. Returns every rank's report by rank, or
    None when a rank did not come in time (the group is destroyed all the same)."""
    reports: list[dict[str, int] | None] | None = [None] * dist.get_world_size()
    try:
        # gloo's monitored barrier is the one with a deadline of its own: the control group's
        # timeout is a year (an idle server's ranks wait on it).
        dist.monitored_barrier(group=channel.control, timeout=timedelta(seconds=timeout_s))
        assert reports is not None
        dist.all_gather_object(reports, report, group=channel.control)
    except RuntimeError:
        reports = None
    dist.destroy_process_group()
    return None if reports is None else [r if r is not None else {} for r in reports]


def abandon_group() -> None:
    """Drop the group after a failure, without meeting the others: a peer may be stuck in
    a collective with this rank, and on NCCL the destroy could wait with it, so there the
    group is left to the process's exit, which frees its communicators (torchrun's ranks
    exit right after). gloo's group is destroyed: nothing there waits for a peer."""
    if dist.get_backend() != "nccl":
        dist.destroy_process_group()
