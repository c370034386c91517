"""Bytes each part of a model will take once loaded, read from the checkpoint's headers
(no tensor data is read), for the layer-split planner.

Quantized linears are counted in the runtime layout they are repacked into
(docs/quant_layout.md): the code words as stored, fp16 scales, zero points (see
kernels.quant_matmul.layout.compact_zero_points: one per group for EXL2 and for GPTQ checkpoints
that say `sym`, else one per group and column; uint8, int16 for GPTQ at 8 bits, whose
zero point may be 256), int32 row->group map and activation permutation. Dense tensors
count in the model's dtype (a bf16 checkpoint loaded as fp32 doubles).
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.cuda_graph import prompt_bucket_of
from engine.placement.plan import ModelFootprint
from engine.weights import WeightStore
from kernels.quant_matmul.dequantize import DEQUANT_SCRATCH_MAX_BYTES


def _tensor_bytes(
    store: WeightStore, name: str, dtype: torch.dtype, symmetric_gptq: bool = False
) -> int:
    info = store.info(name)
    numel = 1
    for dim in info.shape:
        numel *= dim
    leaf = name.rsplit(".", 1)[-1]
    module = name[: -len(leaf) - 1]
    if leaf in ("q_weight", "qweight"):  # int32 code words, kept as they are
        return numel * 4
    if leaf == "q_scale":  # EXL2: 4-bit scales packed 8 per int32 -> fp16 scales, and a
        return numel * 8 * 2 + info.shape[0]  # uint8 zero point per group (2^(bits-1))
    if leaf == "scales" and f"{module}.qweight" in store:  # GPTQ: fp16 scales + zero points
        zeros = info.shape[0] if symmetric_gptq else numel
        return numel * 2 + zeros * _gptq_zero_bytes(store, module, info.shape[-1])
    # -> int32 perm + int32 row_group of length k (EXL2 always has q_invperm; q_perm is
    # optional and counted through it)
    if leaf in ("q_invperm", "g_idx"):
        return numel * 4 * 2
    if leaf in ("q_perm", "qzeros", "q_scale_max", "q_groups"):  # folded into the above
        return 0
    if info.dtype.is_floating_point:
        size = 2 if leaf == "bias" and f"{module}.weight" not in store else dtype.itemsize
        return numel * size
    return numel * info.dtype.itemsize


def _gptq_zero_bytes(store: WeightStore, module: str, n: int) -> int:
    """Bytes per zero point at run time: qzeros packs n of them per row at `bits` each;
    8-bit ones may hold 256 (int16), narrower ones fit uint8."""
    name = f"{module}.qzeros"
    if name not in store or n <= 0:
        return 2
    bits = store.info(name).shape[-1] * 32 // n
    return 2 if bits >= 8 else 1


def _largest_quantized_linear(store: WeightStore) -> int:
    """Elements of the largest quantized linear of the checkpoint (before q/k/v and
    gate/up fuse): prefill dequantizes linears into a dense fp16 scratch for cuBLAS."""
    largest = 0
    for name in store.names():
        if name.endswith((".q_weight", ".qweight")):
            words, n = store.info(name).shape
            module = name.rsplit(".", 1)[0]
            perm = f"{module}.q_invperm" if name.endswith(".q_weight") else f"{module}.g_idx"
            k = store.info(perm).shape[0] if perm in store else words * 8
            largest = max(largest, k * n)
    return largest


def model_footprint(
    store: WeightStore,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    cache_tokens: int,
    page_size: int,
    prefill_chunk: int,
    kv_heads: int | None = None,
    cache_token_bytes: int | None = None,
) -> ModelFootprint:
    """The footprint of the checkpoint in `store` with a cache of `cache_tokens` tokens
    (rounded up to pages, plus the scratch slot of the decode graphs), each taking
    `cache_token_bytes` per layer (K and V; default: the model's dtype, unquantized)."""
    layers = [0] * config.num_hidden_layers
    embed = head = 0
    symmetric = bool((config.quantization_config or {}).get("sym", False))
    for name in store.names():
        size = _tensor_bytes(store, name, dtype, symmetric)
        if name.startswith("model.layers."):
            index = int(name.split(".", 3)[2])
            if index < len(layers):
                layers[index] += size
        elif name.startswith("model.embed_tokens."):
            embed += size
        else:
            head += size
    tied = config.tie_word_embeddings and not any(n.startswith("lm_head.") for n in store.names())
    slots = -(-cache_tokens // page_size) * page_size + 1
    kv = kv_heads if kv_heads is not None else config.num_key_value_heads
    if cache_token_bytes is None:  # K and V of one token and layer, in the model's dtype
        cache_token_bytes = 2 * kv * config.head_dim * dtype.itemsize
    cache_per_layer = slots * cache_token_bytes
    # Activations of one prefill chunk: hidden rows, q/k/v, the MLP's three intermediates,
    # in float32 at worst; the dense scratch of the largest quantized linear; and the
    # float32 logits of a whole chunk (logits() asks for every row).
    width = 4 * config.hidden_size + 3 * config.intermediate_size
    width += (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    # The dense fp16 chunk of the dequantize + cuBLAS path: the largest linear after q/k/v
    # and gate/up fuse (twice the largest checkpoint linear, at most), capped by the
    # column chunking of kernels/quant_matmul/dequantize.py.
    scratch = min(2 * _largest_quantized_linear(store) * 2, DEQUANT_SCRATCH_MAX_BYTES)
    activations = prefill_chunk * width * 4 + scratch
    activations += prefill_chunk * config.vocab_size * 4
    # The prompt graphs' shared pool (engine/cuda_graph.py) holds another set for the
    # bucket a prefill chunk pads to (at most 2048 tokens; their logits: one row), beside
    # the eager allocator's blocks.
    prompt_tokens = prompt_bucket_of(prefill_chunk)
    activations += prompt_tokens * width * 4 + scratch
    return ModelFootprint(
        embed_bytes=embed,
        layer_bytes=layers,
        head_bytes=head,
        cache_bytes_per_layer=cache_per_layer,
        activation_bytes=activations,
        tied_head=tied,
    )
