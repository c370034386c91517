"""Where a tensor-parallel rank loads each layer before it keeps its shard of that layer.

A rank used to load the whole checkpoint onto the CPU, repack its quantized weights there,
cut its shard and move that to its GPU. For a 70B GPTQ model on 2xH100 the two ranks had
not finished after six minutes, where one GPU loads the same model in 10 s (its quantized
weights are repacked on the GPU: engine/quantized_linear.py). So whole layers are now staged
on the rank's GPU, in order, while they fit its free memory next to the embeddings, the
head and the shard being cut; the layers past that load on the CPU (a model far larger than
one GPU still loads) and their shards move over after. Sharding is exact integer slicing on
either device, so the shards are the same (tests/engine/test_tensor_parallel.py checks it on a GPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.placement.plan import GIB, ModelFootprint, Placement

# Left free on the GPU while staging: the allocator's rounding and block splitting, the
# CUDA context's growth once kernels load, and the caller's own tensors.
STAGING_RESERVE_BYTES = 1 * GIB


def staging_placement(
    footprint: ModelFootprint,
    world: int,
    device: torch.device,
    free_bytes: int,
    reserve_bytes: int = STAGING_RESERVE_BYTES,
) -> Placement:
    """Load the embeddings, the head and layers 0..j-1 whole on the rank's GPU `device` and
    layers j.. on the CPU, the largest j whose whole layers fit `free_bytes` less the
    reserve, the embeddings and head (loaded whole, cut by vocabulary rows after: vocab.py)
    and the largest shard (cut while its whole layer still exists). Everything on the CPU
    when the embeddings and head alone do not fit, and for a CPU rank (gloo)."""
    n = footprint.num_layers
    cpu = torch.device("cpu")
    if device.type != "cuda":
        return Placement.single(device, n)
    largest_shard = -(-max(footprint.layer_bytes, default=0) // world)
    room = free_bytes - reserve_bytes - footprint.embed_bytes - footprint.head_bytes
    room -= largest_shard
    if room < 0:
        return Placement.single(cpu, n)
    layers: list[torch.device] = []
    used = 0
    for size in footprint.layer_bytes:
        # In order: once one layer goes to the CPU, the later ones do too (a later small
        # layer could fit, but then the CPU would sit between two GPU runs for nothing).
        if (not layers or layers[-1] == device) and used + size <= room:
            used += size
            layers.append(device)
        else:
            layers.append(cpu)
    return Placement(device, layers, device)


@contextmanager
def staging_pool(device: torch.device) -> Iterator[None]:
    """Allocate what loads inside (the whole staged layers, their repacking temporaries) on
    GPU `device` from a memory pool of its own, released once the layers are cut.

    In the allocator's common pool, each shard cut after the load was carved out of a freed
    whole layer's block, so most of the staged model's segments stayed partly in use and
    could not be handed back: the rank kept memory reserved that it no longer held (see
    rank.rank_memory: torch_reserved against torch_allocated). Tensors a shard keeps of
    its whole layer (the norms, a column shard's k-indexed groups and permutation) are
    small and keep only the pool's small segments alive. Nothing changes on the CPU, or
    where torch has no MemPool."""
    if device.type != "cuda" or not hasattr(torch.cuda, "MemPool"):
        yield
        return
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool, device=device):
        yield
