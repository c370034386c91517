"""Paged KV cache and the batch description that one model forward consumes.

The cache holds, per layer, K and V as [pages, page_size, kv_heads, head_dim] on that
layer's device. A sequence owns a list of pages (its page table); token position p of a
sequence lives in slot `pages[p // page_size] * page_size + p % page_size`.

`ForwardBatch` describes one forward over several sequences: each contributes its new
tokens (a prefill chunk or one decode token). The same object serves prefill and decode,
so the scheduler can mix them in one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class CacheFullError(RuntimeError):
    """No free pages are left for a sequence's new tokens."""


class PagedKVCache:
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
    ) -> None:
        if len(layer_devices) != num_layers:
            raise ValueError(f"{len(layer_devices)} layer devices for {num_layers} layers")
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=d) for d in layer_devices]
        self.v = [torch.zeros(shape, dtype=dtype, device=d) for d in layer_devices]
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise CacheFullError(
                f"the KV cache needs {count} more pages of {self.page_size} tokens, "
                f"{len(self._free)} are free"
            )
        return [self._free.pop() for _ in range(count)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [T, Hk, D] of new tokens at flat slot indices [T]."""
        k_flat = self.k[layer].view(-1, *self.k[layer].shape[2:])
        v_flat = self.v[layer].view(-1, *self.v[layer].shape[2:])
        k_flat.index_copy_(0, slots, k.to(self.dtype))
        v_flat.index_copy_(0, slots, v.to(self.dtype))


@dataclass
class Sequence:
    """One sequence's place in the cache: its pages and how many tokens they hold."""

    pages: list[int] = field(default_factory=list)
    length: int = 0

    def reserve(self, cache: PagedKVCache, new_length: int) -> None:
        needed = -(-new_length // cache.page_size) - len(self.pages)
        if needed > 0:
            self.pages.extend(cache.allocate(needed))

    def release(self, cache: PagedKVCache) -> None:
        cache.release(self.pages)
        self.pages = []
        self.length = 0


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
    _on_device: dict[torch.device, ForwardBatch] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        cache: PagedKVCache,
        sequences: list[Sequence],
        new_tokens: list[list[int]],
        *,
        all_logits: bool = False,
    ) -> ForwardBatch:
        """Reserve pages for the new tokens and describe the forward. The sequences'
        `length` advances here: the forward that follows fills those slots."""
        if len(sequences) != len(new_tokens):
            raise ValueError("one list of new tokens per sequence is needed")
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        lens: list[int] = []
        logits_rows: list[int] = []
        for seq, tokens in zip(sequences, new_tokens, strict=True):
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
            if all_logits:
                logits_rows.extend(range(cu[-1], cu[-1] + len(tokens)))
            elif tokens:
                logits_rows.append(cu[-1] + len(tokens) - 1)
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
            )
        return self._on_device[device]
