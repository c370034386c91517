"""What a loaded model (and its KV cache) holds in memory, part by part.

Counted by storage, not by tensor: a view keeps its whole storage alive (a slice of a
table is the table's size until cloned), and a storage two parts share (a head tied to the
embeddings, layers sharing one RoPE table) counts once, for the first part that holds it,
in the order of PARTS. Tensor parallelism's accounting (engine/tensor_parallel/) compares
each rank's parts against one process's with it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from engine.architectures.base import CausalLM
from engine.cache import PagedKVCache
from engine.quantized_linear import QuantizedLinear

# embed / layers / norm / head: parameters, buffers and quantized weights of those modules;
# rope: the cos/sin tables; kv_cache: every K/V plane (pages and scratch slot);
# cpu_dequantized: the float32 copies the CPU path keeps of quantized linears once used.
PARTS = ("embed", "layers", "norm", "head", "rope", "kv_cache", "cpu_dequantized")


def _module_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    for sub in module.modules():
        yield from sub.parameters(recurse=False)
        yield from sub.buffers(recurse=False)
        if isinstance(sub, QuantizedLinear):
            yield from sub.qweight.tensors()


def _dequantized(model: nn.Module) -> Iterator[torch.Tensor]:
    for sub in model.modules():
        dense = getattr(sub, "_cpu_dense", None)
        if isinstance(sub, QuantizedLinear) and isinstance(dense, torch.Tensor):
            yield dense


def held_bytes(model: CausalLM, cache: PagedKVCache | None = None) -> dict[str, int]:
    """{part: bytes} for every part of PARTS (0 where it holds nothing new)."""
    rotary = [t for r in model._layer_rotary for t in (r.cos, r.sin)]
    kv = [] if cache is None else [*cache.k_slots, *cache.v_slots]
    sources: dict[str, list[torch.Tensor]] = {
        "embed": list(_module_tensors(model.model.embed_tokens)),
        "layers": list(_module_tensors(model.model.layers)),
        "norm": list(_module_tensors(model.model.norm)),
        "head": list(_module_tensors(model.lm_head)),
        "rope": rotary,
        "kv_cache": kv,
        "cpu_dequantized": list(_dequantized(model)),
    }
    seen: set[tuple[torch.device, int]] = set()
    held = dict.fromkeys(PARTS, 0)
    for part in PARTS:
        for t in sources[part]:
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            held[part] += storage.nbytes()
    return held
