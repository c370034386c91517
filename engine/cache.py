"""Paged KV cache and the batch description that one model forward consumes.

The cache holds, per layer, K and V as [pages, page_size, kv_heads, head_dim] on that
layer's device, in the model's dtype for cache_type "fp16", or as byte rows
[pages, page_size, kv_heads, row_bytes] (codes and scales) for the quantized types fp8, q8,
q6 and q4 (layouts: kernels.kv_quant). `write` quantizes new K/V as it stores them and the
attention kernels dequantize tile by tile; `bytes_per_token` is what one token costs.
The layers of one device share one allocation (no per-tensor rounding by the allocator),
and each layer's K and V have one more slot past their pages, `scratch_slot`: the decode
graphs' padding rows write their K/V there, where no page table points, instead of into a
whole page of their own (a 256-token page of an 8B model is 32 MiB). Writers take the
flat view with that slot (`k_slots`, `v_slots`); attention reads the page view (`k`, `v`).
A sequence owns a list of pages (its page table); token position p of a sequence lives in
slot `pages[p // page_size] * page_size + p % page_size`.

`ForwardBatch` describes one forward over several sequences: each contributes its new
tokens (a prefill chunk or one decode token). The same object serves prefill and decode,
so the scheduler can mix them in one step. It also carries the step's LoRA selection
(`lora`), which every projection of the forward is called with.

Page bookkeeping (reference counts, prefix hashes, the LRU of cached pages, `Sequence`)
is `engine.pages.PagePool`, which `PagedKVCache` extends with the storage: the scheduler
keeps the books through the pool's interface alone and never touches K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.lora.batch import LoraBatch
from engine.pages import CacheFullError, PagePool, Sequence
from kernels.kv_quant import CACHE_TYPES, KVFormat, cache_formats, kv_cache_write

__all__ = ["CACHE_TYPES", "CacheFullError", "ForwardBatch", "PagedKVCache", "Sequence"]


def cache_bytes_per_token(
    cache_type: str, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of K and V that one token occupies over all layers."""
    k_format, v_format = cache_formats(cache_type)
    per_head = k_format.bytes_per_head_row(head_dim, dtype) + v_format.bytes_per_head_row(
        head_dim, dtype
    )
    return num_layers * num_kv_heads * per_head


class PagedKVCache(PagePool):
    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        layer_devices: list[torch.device],
        cache_type: str = "fp16",
    ) -> None:
        if len(layer_devices) != num_layers:
            raise ValueError(f"{len(layer_devices)} layer devices for {num_layers} layers")
        super().__init__(num_pages=num_pages, page_size=page_size)
        self.dtype = dtype  # the model's: what attention computes in and K/V arrive as
        self.cache_type = cache_type
        self.k_format, self.v_format = cache_formats(cache_type)
        for fmt in (self.k_format, self.v_format):
            if fmt.quantized:
                fmt.group_size(head_dim)  # raises for a head_dim the format cannot group
        self.bytes_per_token = cache_bytes_per_token(
            cache_type,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
        )

        # The slot past the last page (see the module docstring).
        self.scratch_slot = num_pages * page_size

        def planes(fmt: KVFormat) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            """Per layer: the flat slots [pages * page_size + 1, Hk, row] and their page
            view [pages, page_size, Hk, row], all layers of a device in one tensor."""
            row = (num_kv_heads, fmt.row_bytes(head_dim) if fmt.quantized else head_dim)
            store = torch.uint8 if fmt.quantized else dtype
            flat: list[torch.Tensor | None] = [None] * num_layers
            for device in dict.fromkeys(layer_devices):
                layers = [i for i, d in enumerate(layer_devices) if d == device]
                block = torch.zeros(
                    (len(layers), self.scratch_slot + 1, *row), dtype=store, device=device
                )
                for j, i in enumerate(layers):
                    flat[i] = block[j]
            slots = [t for t in flat if t is not None]
            pages = [t[: self.scratch_slot].view(num_pages, page_size, *row) for t in slots]
            return slots, pages

        self.k_slots, self.k = planes(self.k_format)
        self.v_slots, self.v = planes(self.v_format)

    @property
    def total_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [T, Hk, D] of new tokens at flat slot indices [T], quantizing them
        for a quantized cache type (a Triton kernel on CUDA)."""
        kv_cache_write(k, self.k_slots[layer], slots, self.k_format)
        kv_cache_write(v, self.v_slots[layer], slots, self.v_format)


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64, flat cache slot of each new token
    cu_seqlens: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32, cache length after this forward
    page_table: torch.Tensor  # [B, max_pages] int32
    logits_indices: torch.Tensor  # [N] int64, rows of T whose logits are returned
    max_query_len: int = 0  # host-side bounds, so kernels pick grids without a GPU sync
    max_context_len: int = 0
    # One sequence whose new tokens are its whole context (nothing cached before them): its
    # attention needs no page table (kernels.attention.prompt_attention).
    fresh: bool = False
    # Each row's LoRA adapters (engine/lora/batch.py); None: no row uses one.
    lora: LoraBatch | None = None
    _on_device: dict[torch.device, ForwardBatch] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        cache: PagedKVCache,
        sequences: list[Sequence],
        new_tokens: list[list[int]],
        *,
        all_logits: bool = False,
        logits_counts: list[int] | None = None,
        lora: LoraBatch | None = None,
    ) -> ForwardBatch:
        """Reserve pages for the new tokens and describe the forward. The sequences'
        `length` advances here: the forward that follows fills those slots.

        Logits come for each sequence's last new token, or its last `logits_counts[b]`
        (speculative verification), or every new token with `all_logits`."""
        if len(sequences) != len(new_tokens):
            raise ValueError("one list of new tokens per sequence is needed")
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        lens: list[int] = []
        logits_rows: list[int] = []
        for b, (seq, tokens) in enumerate(zip(sequences, new_tokens, strict=True)):
            start = seq.length
            seq.reserve(cache, start + len(tokens))
            for p in range(start, start + len(tokens)):
                slots.append(
                    seq.pages[p // cache.page_size] * cache.page_size + p % cache.page_size
                )
            positions.extend(range(start, start + len(tokens)))
            token_ids.extend(tokens)
            seq.length = start + len(tokens)
            lens.append(seq.length)
            wanted = len(tokens) if all_logits else logits_counts[b] if logits_counts else 1
            end = cu[-1] + len(tokens)
            logits_rows.extend(range(end - min(wanted, len(tokens)), end))
            cu.append(cu[-1] + len(tokens))
        max_pages = max((len(s.pages) for s in sequences), default=1) or 1
        table = torch.zeros((len(sequences), max_pages), dtype=torch.int32)
        for b, seq in enumerate(sequences):
            table[b, : len(seq.pages)] = torch.tensor(seq.pages, dtype=torch.int32)
        return cls(
            token_ids=torch.tensor(token_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slots=torch.tensor(slots, dtype=torch.int64),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32),
            context_lens=torch.tensor(lens, dtype=torch.int32),
            page_table=table,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
            max_query_len=max((len(t) for t in new_tokens), default=0),
            max_context_len=max(lens, default=0),
            fresh=len(sequences) == 1 and lens[0] == len(new_tokens[0]),
            lora=lora,
        )

    def on(self, device: torch.device) -> ForwardBatch:
        """This batch's index tensors on `device` (copied once per device and forward)."""
        if self.token_ids.device == device:
            return self
        if device not in self._on_device:
            self._on_device[device] = ForwardBatch(
                token_ids=self.token_ids.to(device),
                positions=self.positions.to(device),
                slots=self.slots.to(device),
                cu_seqlens=self.cu_seqlens.to(device),
                context_lens=self.context_lens.to(device),
                page_table=self.page_table.to(device),
                logits_indices=self.logits_indices.to(device),
                max_query_len=self.max_query_len,
                max_context_len=self.max_context_len,
                fresh=self.fresh,
                lora=self.lora,  # its segments copy themselves per device (LoraSegments.on)
            )
        return self._on_device[device]
