"""Rank 0's shard spec, handed to the ranks torchrun started before any of them loads.

Why rank 0 sends its spec instead of every rank computing one from its own command line:
the spec fixes each rank's cache pages, sequence length, dtype, cache type and RoPE
settings, and two ranks that build different caches or shapes read wrong pages or fail in
a collective with no word of why. Each rank computing "the same" spec holds only while every
input is the same on every rank: the command line typed on each machine, the model copy
there, and any size derived from the machine itself (a cache sized from free GPU memory
differs per GPU). Checking the ranks' specs against each other after loading would catch
a difference only once all of them have spent the load. So rank 0 alone resolves the
options, and the others take its spec as it is: nothing of theirs can differ. What stays
per rank is where the model lives on its machine (checked to be the same model: its
config.json), how many ranks its machine runs, and its load clock.

The spec travels through torchrun's own store (MASTER_ADDR:MASTER_PORT, the one
torch.distributed's env:// rendezvous reaches, served by torchrun's agent or by rank 0);
the process group is then joined through the same store object.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
from torch._C._distributed_c10d import PrefixStore, Store
from torch.distributed.rendezvous import rendezvous

from engine.tensor_parallel.errors import TensorParallelError
from engine.tensor_parallel.launched import LaunchedRank
from engine.tensor_parallel.rank import ShardSpec

_KEY = "shard_spec"


def rendezvous_store(timeout_s: float) -> Store:
    """torchrun's store, reached as init_process_group's env:// reaches it (MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE). Rank 0 may have to wait here until every rank has
    connected (when rank 0 hosts the store)."""
    store: Store = next(rendezvous("env://", timeout=timedelta(seconds=timeout_s)))[0]
    return store


def _keys(store: Store) -> Store:
    # A restarted launch (torchrun --max-restarts) reuses the agent's store: one key per try.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"kestrel/{attempt}", store)


def config_digest(model_dir: str | Path) -> str:
    """What tells two copies of a model apart cheaply: its config.json, byte for byte."""
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()


def publish_spec(store: Store, spec: ShardSpec | None, error: str | None = None) -> None:
    """Rank 0: the spec every rank loads with, or why rank 0 will not load (so that the
    other ranks stop with that error instead of waiting for a spec that never comes)."""
    message: dict[str, object]
    if spec is None:
        message = {"error": error or "rank 0 failed before loading"}
    else:
        message = {"spec": dataclasses.asdict(spec), "config": config_digest(spec.model_dir)}
    _keys(store).set(_KEY, json.dumps(message))


def receive_spec(
    store: Store, launched: LaunchedRank, model_dir: Path, started_at: float, timeout_s: float
) -> ShardSpec:
    """Ranks 1..: rank 0's spec, with this rank's own model directory (the same model:
    checked), ranks per machine and load clock."""
    keys = _keys(store)
    keys.wait([_KEY], timedelta(seconds=timeout_s))
    message = json.loads(keys.get(_KEY))
    if "error" in message:
        raise TensorParallelError(f"rank 0 did not load: {message['error']}")
    spec = ShardSpec(**message["spec"])
    if config_digest(model_dir) != message["config"]:
        raise TensorParallelError(
            f"rank {launched.rank}'s model {model_dir} is not the model rank 0 loads "
            f"({spec.model_dir}): their config.json files differ"
        )
    if spec.device_type == "cuda" and torch.cuda.device_count() < launched.local_world_size:
        raise TensorParallelError(
            f"rank {launched.rank}: {launched.local_world_size} ranks on this machine need as "
            f"many GPUs, {torch.cuda.device_count()} are visible"
        )
    return dataclasses.replace(
        spec,
        model_dir=str(model_dir),
        local_world_size=launched.local_world_size,
        started_at=started_at,
    )
