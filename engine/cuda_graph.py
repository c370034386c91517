"""CUDA graphs for decode steps: one captured forward per batch-size bucket.

A decode step of a quantized 8B model is some 600 small kernel launches; launched one by
one from Python they cost more than the kernels themselves. `DecodeGraphs` captures the
model forward for B sequences of one new token each, with every input in a static device
buffer, and replays it: one launch per step.

Static shapes: the page table has room for the engine's whole context, and attention is
told the context may be that long (`max_context_len` sizes the decode kernel's grid, so it
must not change between replays). Buckets are padded with dummy sequences whose one token
lands in a scratch page that no real sequence owns.

Steps where some row uses a LoRA adapter replay a second set of graphs, captured with the
LoRA kernels and a static [B, slots] scale buffer that each step fills. They hold the
adapters' stack addresses, so they are dropped whenever the LoRA manager's `version`
changes (an adapter was loaded or unloaded) and captured again on next use.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from engine.cache import ForwardBatch, PagedKVCache, Sequence

if TYPE_CHECKING:
    from engine.lora import LoraManager

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class _Graph:
    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedKVCache,
        batch_size: int,
        max_pages: int,
        max_context: int,
        scratch_page: int,
        device: torch.device,
        lora: LoraManager | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.scratch_page = scratch_page
        self.page_size = cache.page_size
        B = batch_size
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.batch = ForwardBatch(
            token_ids=torch.zeros(B, **i64),
            positions=torch.zeros(B, **i64),
            slots=torch.full((B,), scratch_page * cache.page_size, **i64),
            cu_seqlens=torch.arange(B + 1, **i32),
            context_lens=torch.ones(B, **i32),
            page_table=torch.full((B, max_pages), scratch_page, **i32),
            logits_indices=torch.arange(B, **i64),
            max_query_len=1,
            max_context_len=max_context,
        )
        # Host staging rows, copied to the device buffers in one go per step.
        self.host = torch.zeros((B, 4 + max_pages), dtype=torch.int64).pin_memory()
        self.device_rows = torch.zeros((B, 4 + max_pages), **i64)

        # A LoRA graph reads each row's adapter scales from a static buffer.
        lora_batch = lora.static_batch(B, device) if lora is not None else None
        self.lora_scales = lora_batch.body.scales if lora_batch is not None else None
        active = lora.active(lora_batch) if lora is not None else contextlib.nullcontext()

        # Warm up outside the graph: compiles kernels and fills the quant kernels' caches,
        # which take one host sync the first time they see a weight.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with active:
            with torch.cuda.stream(stream):
                for _ in range(2):
                    model(self.batch, cache)
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = model(self.batch, cache)

    def run(
        self,
        sequences: list[Sequence],
        tokens: list[int],
        lora_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.stage(sequences, tokens, lora_scales)
        return self.replay()[: len(sequences)]

    def stage(
        self,
        sequences: list[Sequence],
        tokens: list[int],
        lora_scales: torch.Tensor | None = None,
    ) -> None:
        """Write the step's inputs into the device rows (`device_rows`) and, in a LoRA
        graph, the rows' adapter scales."""
        n = len(sequences)
        if self.lora_scales is not None:
            self.lora_scales.zero_()
            if lora_scales is not None:
                self.lora_scales[:n].copy_(lora_scales)
        host = self.host
        host[:, 0] = 0
        host[:, 1] = 0
        host[:, 2] = self.scratch_page * self.page_size
        host[:, 3] = 1
        host[:, 4:] = self.scratch_page
        for b, (seq, token) in enumerate(zip(sequences, tokens, strict=True)):
            pos = seq.length - 1  # the caller has reserved and advanced the sequence
            host[b, 0] = token
            host[b, 1] = pos
            host[b, 2] = seq.pages[pos // self.page_size] * self.page_size + pos % self.page_size
            host[b, 3] = seq.length
            host[b, 4 : 4 + len(seq.pages)] = torch.tensor(seq.pages)
        self.device_rows.copy_(host, non_blocking=True)

    def replay(self) -> torch.Tensor:
        """Run the captured forward on what `device_rows` holds; logits [batch_size, vocab].
        (Tensor-parallel ranks other than 0 receive `device_rows` instead of staging them.)"""
        rows = self.device_rows
        batch = self.batch
        batch.token_ids.copy_(rows[:, 0])
        batch.positions.copy_(rows[:, 1])
        batch.slots.copy_(rows[:, 2])
        batch.context_lens.copy_(rows[:, 3])
        batch.page_table.copy_(rows[:, 4:])
        self.graph.replay()
        return self.logits


class DecodeGraphs:
    """Captured decode forwards, one per bucket, made on first use."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, max_seq_len: int) -> None:
        self.model = model
        self.cache = cache
        self.max_pages = -(-max_seq_len // cache.page_size)
        self.max_context = max_seq_len
        self.device = model.lm_head_device
        # The scratch page absorbs the K/V writes of padding rows; no sequence owns it.
        self.scratch_page = cache.allocate(1)[0]
        self._graphs: dict[int, _Graph] = {}
        # Graphs with LoRA kernels, valid while the adapters' stacks stay where they were.
        self._lora_graphs: dict[int, _Graph] = {}
        self._lora_version = -1

    @staticmethod
    def bucket(batch_size: int) -> int | None:
        return next((b for b in BUCKETS if b >= batch_size), None)

    def decode(
        self,
        sequences: list[Sequence],
        tokens: list[int],
        *,
        lora: LoraManager | None = None,
        lora_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step: logits [len(sequences), vocab] (float32). With `lora`, the rows'
        adapter scales `lora_scales` [len(sequences), slots] (CPU) go into a LoRA graph."""
        for seq in sequences:
            seq.reserve(self.cache, seq.length + 1)
            seq.length += 1
        size = self.bucket(len(sequences))
        assert size is not None, "more sequences than the largest bucket"
        return self.graph(size, lora).run(sequences, tokens, lora_scales)

    def graph(self, size: int, lora: LoraManager | None = None) -> _Graph:
        """The captured forward of bucket `size` (with LoRA kernels when `lora` is given),
        captured on first use."""
        graphs = self._graphs
        if lora is not None:
            if lora.version != self._lora_version:
                self._lora_graphs.clear()  # they read stacks that no longer exist
                self._lora_version = lora.version
            graphs = self._lora_graphs
        graph = graphs.get(size)
        if graph is None:
            graph = graphs[size] = _Graph(
                self.model,
                self.cache,
                size,
                self.max_pages,
                self.max_context,
                self.scratch_page,
                self.device,
                lora,
            )
        return graph

    def drop_lora_graphs(self) -> None:
        """Free the LoRA graphs (and their memory pools) now; they are captured again
        when a LoRA decode step next needs them."""
        self._lora_graphs.clear()

    def release(self) -> None:
        self._graphs.clear()
        self._lora_graphs.clear()
        self.cache.release([self.scratch_page])
