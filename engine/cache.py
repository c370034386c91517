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
so the scheduler can mix them in one step.

Page bookkeeping (what prefix caching rests on):

- Every page has a reference count: the number of sequences whose page table holds it.
  `allocate` hands out pages at count 1, `acquire` adds a holder, `release` drops one.
- A page may carry a prefix hash (`register`, see engine/prefix_cache.py): it then holds
  the K/V of one exact run of tokens from position 0, and other sequences whose tokens
  start the same way may `acquire` it instead of recomputing it.
- Invariant: only full pages are hashed, and a hashed or shared page is never written.
  Writes go to positions >= a sequence's length, i.e. into its partially filled last page
  or fresh pages, and that last page is always private (count 1, no hash): a sequence
  adopts only whole pages, so its length then ends on a page boundary, and a page is
  hashed only once full. So copy-on-write never has to copy (the scheduler adopts at most
  the pages before a prompt's last token, which it must compute for the logits anyway);
  `Sequence.reserve` raises if the invariant is ever broken.
- A page whose count drops to 0 goes back to the free list, or, if it is hashed, to an
  LRU of cached-but-unused pages that `acquire` can revive. `allocate` takes free pages
  first and then evicts from that LRU, oldest first. `free_pages` counts both: a cached
  but unused page is as good as free to a caller that needs room.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from engine.errors import KestrelError
from kernels.kv_quant import CACHE_TYPES, cache_formats, kv_cache_write

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


class CacheFullError(KestrelError, RuntimeError):
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
        cache_type: str = "fp16",
    ) -> None:
        if len(layer_devices) != num_layers:
            raise ValueError(f"{len(layer_devices)} layer devices for {num_layers} layers")
        self.page_size = page_size
        self.num_pages = num_pages
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

        def planes(fmt) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
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
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}  # page -> prefix hash
        self._page_of: dict[bytes, int] = {}  # prefix hash -> page
        self._lru: OrderedDict[int, None] = OrderedDict()  # hashed pages at count 0

    @property
    def free_pages(self) -> int:
        """Pages `allocate` can hand out: never used plus cached but unreferenced."""
        return len(self._free) + len(self._lru)

    @property
    def cached_pages(self) -> int:
        """Pages that carry a prefix hash, in use or not."""
        return len(self._hash_of)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def is_shared(self, page: int) -> bool:
        """Whether writing into `page` could change what another sequence reads."""
        return self._refs[page] > 1 or page in self._hash_of

    def allocate(self, count: int) -> list[int]:
        if count > self.free_pages:
            raise CacheFullError(
                f"the KV cache needs {count} more pages of {self.page_size} tokens, "
                f"{self.free_pages} are free"
            )
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def acquire(self, pages: list[int]) -> None:
        """Add a holder to pages another sequence holds or the LRU keeps."""
        for page in pages:
            if self._refs[page] == 0:
                if page not in self._lru:
                    raise RuntimeError(f"page {page} is free; only cached pages can be acquired")
                del self._lru[page]
            self._refs[page] += 1

    def release(self, pages: list[int]) -> None:
        # Last page first: the LRU then evicts the end of a prefix before its start, and a
        # prefix is only ever found from its start; the free list hands out pages in order.
        for page in reversed(pages):
            if self._refs[page] <= 0:
                raise RuntimeError(f"page {page} released more often than it was held")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    def lookup(self, prefix_hash: bytes) -> int | None:
        """The page holding the tokens that `prefix_hash` names, if it is still cached."""
        return self._page_of.get(prefix_hash)

    def register(self, page: int, prefix_hash: bytes) -> bool:
        """Mark a full, held page as holding the tokens `prefix_hash` names.

        Returns False (and leaves the page private) when another page already holds them:
        two jobs prefilled the same prefix at once, and the first one's page serves."""
        if self._refs[page] <= 0:
            raise RuntimeError(f"page {page} is not held; only held pages can be registered")
        known = self._page_of.get(prefix_hash)
        if known is not None or page in self._hash_of:
            return known == page
        self._page_of[prefix_hash] = page
        self._hash_of[page] = prefix_hash
        return True

    def clear_prefix_cache(self) -> None:
        """Forget every prefix hash; unreferenced cached pages become plain free pages."""
        self._free.extend(reversed(self._lru))
        self._lru.clear()
        self._hash_of.clear()
        self._page_of.clear()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [T, Hk, D] of new tokens at flat slot indices [T], quantizing them
        for a quantized cache type (a Triton kernel on CUDA)."""
        kv_cache_write(k, self.k_slots[layer], slots, self.k_format)
        kv_cache_write(v, self.v_slots[layer], slots, self.v_format)


@dataclass
class Sequence:
    """One sequence's place in the cache: its pages and how many tokens they hold."""

    pages: list[int] = field(default_factory=list)
    length: int = 0

    def reserve(self, cache: PagedKVCache, new_length: int) -> None:
        """Make room for tokens up to `new_length`; they will be written at positions
        `length`..`new_length - 1`."""
        if new_length > self.length and self.length % cache.page_size:
            # The page the write starts in must be private (see the module docstring).
            page = self.pages[self.length // cache.page_size]
            if cache.is_shared(page):
                raise RuntimeError(f"page {page} is shared and must not be written")
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
    # One sequence whose new tokens are its whole context (nothing cached before them): its
    # attention needs no page table (kernels.prompt_attention).
    fresh: bool = False
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
            )
        return self._on_device[device]
