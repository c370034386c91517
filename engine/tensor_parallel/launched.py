"""Ranks started by torch's own launcher (torchrun), on one machine or several.

torchrun sets each process's place in its environment: RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Such ranks join one process group through
torch.distributed's environment rendezvous (`env://`) instead of the processes Kestrel
spawns itself; rank r uses GPU LOCAL_RANK of its machine. Rank 0 is the engine (and
serves the CLI or the API); the others run their shard until rank 0 stops them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchedRank:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # ranks on this machine (GPUs per node)


def launched_rank(environ: Mapping[str, str] | None = None) -> LaunchedRank | None:
    """This process's place in a torchrun launch, or None when not started that way.
    Read once at load time, never in a step."""
    env = os.environ if environ is None else environ
    if not all(name in env for name in _REQUIRED):
        return None
    try:
        world_size = int(env["WORLD_SIZE"])
        return LaunchedRank(
            rank=int(env["RANK"]),
            world_size=world_size,
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
        )
    except ValueError as e:
        raise ValueError(f"torchrun's environment is malformed: {e}") from None
