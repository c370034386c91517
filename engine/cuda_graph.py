"""CUDA graphs for decode steps: one captured forward per batch-size bucket (per device
segment of a layer-split model).

A decode step of a quantized 8B model is some 600 small kernel launches; launched one by
one from Python they cost more than the kernels themselves. `DecodeGraphs` captures the
model forward for B sequences of one new token each, with every input in a static device
buffer, and replays it: one launch per step.

Static shapes: the page table has room for the engine's whole context, and attention is
told the context may be that long (`max_context_len` sizes the decode kernel's grid, so it
must not change between replays). Buckets are padded with dummy sequences whose one token
writes its K/V to the cache's scratch slot (engine.cache: one slot past the last page, in
no page table) and reads page 0, whatever it holds: a padding row's output is dropped.

A captured graph keeps raw device addresses, not tensors: every tensor its kernels read
must be owned by the `_Graph` for as long as it may replay (a tensor that only a local
variable of the capture held is freed after it, and the allocator hands its memory to the
next small tensor, e.g. the sampler's, which the replay then reads as input).

Steps of a few tokens per sequence (speculative verification: the last token and its
drafts; a draft model catching up on accepted tokens) replay graphs captured for B rows of
T tokens each (T in TOKEN_BUCKETS, B * T <= MAX_GRAPH_TOKENS). A row with fewer tokens is
padded at its end: the padding tokens write their K/V to the scratch slot, and causal
attention keeps every real token from seeing them, so the real tokens' logits are those of
an unpadded forward. Without these graphs such a step ran eagerly, ~600 launches from
Python: on an H200 the 8B model's verify step took ~25 ms, which made speculative decoding
slower than plain decoding.

Steps where some row uses a LoRA adapter replay a second set of graphs, captured with the
LoRA kernels and a static `LoraBatch` owned by the graph: segment starts [B+1] (one row
each) and a [B, slots] scale buffer that each step fills (0 for padding rows and unused
slots), so scales and adapter mixes change per step without a new capture. Python-side
branches of the LoRA modules are taken once, at capture, as for a step where no row uses a
replacement (modules_to_save); steps that do run eagerly (`LoraManager.graphable`). The
graphs also hold the addresses of the adapters' stacks and slot maps, so they are dropped
whenever the LoRA manager's `version` changes (an adapter was loaded or unloaded: stacks
re-allocated, slots renumbered) and captured again on next use.

A prompt that starts a sequence (9 to 2048 tokens, the default prefill chunk; no LoRA;
`prompt_bucket`) replays a prompt graph: one row of T tokens (T in PROMPT_BUCKETS), padded
at its end like the rows above, whose forward takes the fresh-prompt attention
(`ForwardBatch.fresh`) and computes the logits of the last real token only (its index is
derived on the device from the row's positions, which padding holds at the last real one).
Eagerly, a 512-token prefill of an 8B model is some 290 launches from Python: on an H100
its kernels took 18 ms and the prefill 27-51 ms. All prompt graphs of a device share one
memory pool (they never run at the same time), and their logits are copied out of it,
since a later replay of another prompt graph may reuse that memory.

A layer-split model (engine/placement/) is captured as one graph per device: a segment
runs the embeddings and the layers on the first device, the next segment the layers on
the next device, ..., the last one ends with the final norm and head (`plan_segments`).
A CUDA graph (and torch's capture, with its memory pool) belongs to one device, so each
segment is captured on its own device's stream, with its own static batch (page table,
positions, slots, context lengths: the page numbers are the same on every device, since
each layer's K/V planes have all pages on that layer's device) and, in a LoRA graph, its
own static LoRA batch. A step stages the host rows once and copies them to every
segment's device, then replays the segments in order; between two replays the previous
segment's static output (hidden states [B*T, hidden]) is copied into the next segment's
static input buffer, device to device (torch orders the copy after the first device's
work and the next device's work after the copy, so nothing waits on the host). Eagerly,
a split decode step is ~600 launches from Python plus a copy per boundary: on 2 H200s
10x slower than one GPU's graph. A single-device model is one segment.

`capture=False` builds the same static buffers and stages them the same way, but runs the
forward on them eagerly instead of replaying: the CPU tests check the graph path's inputs
with it, and on a GPU it separates a wrong input from a wrong capture. `split_at` cuts a
one-device model into segments too, so the segmented path (the copies between segments,
each segment's own buffers) is tested on the CPU and captured on a single GPU.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.cache import ForwardBatch, PagedKVCache, Sequence

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from engine.architectures.base import CausalLM
    from engine.lora import LoraBatch, LoraManager

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


TOKEN_BUCKETS = (1, 2, 4, 8)  # new tokens per row of a graph
MAX_GRAPH_TOKENS = 64  # rows * tokens of a multi-token graph (its activations, its logits)
# Prompt graphs: a fresh prompt of up to this many tokens (see the module docstring).
PROMPT_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def prompt_bucket_of(tokens: int) -> int:
    """The prompt graph that holds `tokens` (the largest for more than it holds)."""
    return next((t for t in PROMPT_BUCKETS if t >= tokens), PROMPT_BUCKETS[-1])


def stage_rows(
    host: torch.Tensor,
    sequences: list[Sequence],
    new_tokens: list[list[int]],
    tokens_per_row: int,
    page_size: int,
    scratch_slot: int,
) -> None:
    """Fill a graph's host rows [B, 3T + 1 + max_pages] for a step: per row its T token
    ids, T positions, T cache slots, the context length, then its page table. Sequences have
    been advanced past their new tokens. A row with n < T tokens is padded at its end
    (token 0, the last real position, the scratch slot) and claims a context of start + T,
    so its real tokens keep their positions (ctx - T + i); bucket rows past the sequences
    are all padding: the scratch slot, and a page table of page 0 (read, never written)."""
    T = tokens_per_row
    # Through numpy (the same memory): this runs on the host before every decode step while
    # the GPU waits, and a numpy slice assignment costs a fraction of a torch op's dispatch.
    rows = host.numpy()
    rows[:] = 0
    lanes = np.arange(T)
    rows[:, 2 * T : 3 * T] = scratch_slot
    rows[:, 3 * T] = T
    rows[:, T : 2 * T] = lanes
    for b, (seq, tokens) in enumerate(zip(sequences, new_tokens, strict=True)):
        n = len(tokens)
        start = seq.length - n
        rows[b, :n] = tokens
        # Padding repeats the last real position (inside the rope tables).
        rows[b, T : 2 * T] = np.minimum(lanes + start, seq.length - 1)
        if n > TOKEN_BUCKETS[-1]:  # a prompt graph's row: vectorized
            p = np.arange(start, start + n)
            pages = np.asarray(seq.pages, dtype=np.int64)
            rows[b, 2 * T : 2 * T + n] = pages[p // page_size] * page_size + p % page_size
        else:  # a few tokens (decode: one): a plain loop costs less than numpy's setup
            for i in range(n):
                pos = start + i
                rows[b, 2 * T + i] = seq.pages[pos // page_size] * page_size + pos % page_size
        rows[b, 3 * T] = start + T
        rows[b, 3 * T + 1 : 3 * T + 1 + len(seq.pages)] = seq.pages


@dataclass(frozen=True)
class Segment:
    """The share of a forward that one graph captures: on `device`, the embeddings (the
    first segment), decoder layers [start, stop), then the final norm and head (the last)."""

    device: torch.device
    start: int
    stop: int
    embed: bool
    head: bool


def plan_segments(model: CausalLM, split_at: Collection[int] = ()) -> list[Segment]:
    """The model's forward cut where the device changes (a layer split: one segment per
    device), and also before each layer index in `split_at` (tests: a model on one device
    run as several segments). A single-device model is one segment."""
    layers = len(model.layer_devices)
    if any(not 0 <= i <= layers for i in split_at):
        raise ValueError(f"split_at {sorted(split_at)} must name layers 0..{layers}")
    # Parts in forward order: embeddings, layer 0 .. layer L-1, head.
    devices = [model.embed_device, *model.layer_devices, model.lm_head_device]
    starts = [0] + [
        part
        for part in range(1, layers + 2)
        if devices[part] != devices[part - 1] or part - 1 in split_at
    ]
    ends = [*starts[1:], layers + 2]
    return [
        Segment(
            device=devices[a],
            start=max(a, 1) - 1,
            stop=min(b, layers + 1) - 1,
            embed=a == 0,
            head=b == layers + 2,
        )
        for a, b in zip(starts, ends, strict=True)
    ]


class _SegmentGraph:
    """One segment of a `_Graph`: the static batch and LoRA batch on its device, its
    static input (the previous segment's hidden states; the first reads token ids) and
    its captured forward, whose output stays where the capture put it."""

    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        segment: Segment,
        batch_size: int,
        tokens_per_row: int,
        width: int,
        max_pages: int,
        max_context: int,
        lora: LoraManager | None,
        prompt: bool = False,
    ) -> None:
        self.model = model
        self.prompt = prompt
        self.cache = cache
        self.segment = segment
        self.device = device = segment.device
        B, T = batch_size, tokens_per_row
        i64: dict[str, Any] = {"dtype": torch.int64, "device": device}
        i32: dict[str, Any] = {"dtype": torch.int32, "device": device}
        self.batch = ForwardBatch(
            token_ids=torch.zeros(B * T, **i64),
            positions=torch.zeros(B * T, **i64),
            slots=torch.full((B * T,), cache.scratch_slot, **i64),
            cu_seqlens=torch.arange(B + 1, **i32) * T,
            context_lens=torch.full((B,), T, **i32),
            page_table=torch.zeros((B, max_pages), **i32),
            # A prompt graph: each row's last real token, set per step (load_rows).
            logits_indices=torch.zeros(B, **i64) if prompt else torch.arange(B * T, **i64),
            max_query_len=T,
            max_context_len=max_context,
            fresh=prompt,
        )
        self.row_starts = torch.arange(B, **i64) * T
        # The step's rows on this device (see _Graph), unpacked into `batch` per replay.
        self.device_rows = torch.zeros((B, width), **i64)
        self.lora = lora
        self.lora_batch: LoraBatch | None = (
            lora.static_batch(B, device) if lora is not None else None
        )
        self.batch.lora = self.lora_batch  # what the captured projections read
        # The previous segment's output copied here before each replay; set by _Graph.
        self.hidden: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None

    def forward(self) -> torch.Tensor:
        """The forward that is captured: this segment's share of the model on the static
        batch (and the static LoRA batch in a LoRA graph). Hidden states [B*T, hidden],
        or from the last segment the logits [B*T, vocab]."""
        with torch.inference_mode():
            seg, model = self.segment, self.model
            h = model.forward_embed(self.batch) if seg.embed else self.hidden
            assert h is not None, "a segment after the first needs its input buffer"
            return model.forward_span(h, self.batch, self.cache, seg.start, seg.stop, head=seg.head)

    def warm_up(self) -> torch.Tensor:
        """Run the forward eagerly on a side stream, as a capture needs first: it compiles
        kernels and fills the quant kernels' caches, which take one host sync the first
        time they see a weight. Returns the output (the next segment's first input)."""
        device = self.device
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    out = self.forward()
            torch.cuda.current_stream(device).wait_stream(stream)
        return out

    def capture(self, pool: _POOL_HANDLE | None = None) -> None:
        device = self.device
        with torch.cuda.device(device):
            self.graph = torch.cuda.CUDAGraph()
            # A capture stream of this device: torch.cuda.graph's default one is made once,
            # on whichever device was current then.
            stream = torch.cuda.Stream(device)
            with torch.cuda.graph(self.graph, pool=pool, stream=stream):
                # The unpacking is part of the graph: five copies that would otherwise be
                # five launches from the host per step.
                self.load_rows()
                self.output = self.forward()

    def load_rows(self) -> None:
        """Unpack `device_rows` into the static batch (on this device, asynchronously; a
        captured graph does it as its first nodes)."""
        rows, batch = self.device_rows, self.batch
        T = batch.max_query_len
        batch.token_ids.copy_(rows[:, :T].reshape(-1))
        batch.positions.copy_(rows[:, T : 2 * T].reshape(-1))
        batch.slots.copy_(rows[:, 2 * T : 3 * T].reshape(-1))
        batch.context_lens.copy_(rows[:, 3 * T])
        batch.page_table.copy_(rows[:, 3 * T + 1 :])
        if self.prompt:
            # Padding repeats the last real position: the row's last real token is
            # (last position - first position) tokens into the row.
            batch.logits_indices.copy_(rows[:, 2 * T - 1] - rows[:, T] + self.row_starts)

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            self.load_rows()
            return self.forward()
        with torch.cuda.device(self.device):
            self.graph.replay()
        assert self.output is not None
        return self.output


class _Graph:
    """The captured forward of one shape: one `_SegmentGraph` per segment (a layer-split
    model: one per device), replayed in order with the hidden states copied from each
    segment's static output into the next one's static input."""

    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        batch_size: int,
        max_pages: int,
        max_context: int,
        segments: list[Segment],
        lora: LoraManager | None = None,
        tokens_per_row: int = 1,
        *,
        capture: bool = True,
        prompt: bool = False,
        pools: dict[torch.device, _POOL_HANDLE] | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.tokens_per_row = T = tokens_per_row
        self.scratch_slot = cache.scratch_slot
        self.page_size = cache.page_size
        self.replays = 0
        B = batch_size
        # Host staging rows, copied to every segment's device in one go per step (pinned
        # when a segment is on a GPU, so the copies are asynchronous): per row its T tokens,
        # T positions, T slots, the context length, then the page table (`stage_rows`).
        pin = any(s.device.type == "cuda" for s in segments)
        self.width = 3 * T + 1 + max_pages
        self.host = _host((B, self.width), torch.int64, pin)
        self.segments = [
            _SegmentGraph(model, cache, s, B, T, self.width, max_pages, max_context, lora, prompt)
            for s in segments
        ]
        # Recorded after a step's copies, one per GPU: the next step waits for them before it
        # rewrites the pinned host buffers, which an unfinished asynchronous copy may read.
        self._copied = {
            s.device: torch.cuda.Event() for s in segments if s.device.type == "cuda" and pin
        }

        # LoRA: each segment owns the static batch its LoRA kernels read (see the module
        # docstring); the graph remembers the manager's version, i.e. which stacks it was
        # captured against.
        self.lora = lora
        self.lora_version = lora.version if lora is not None else None
        self.lora_host = (
            _host((B, len(lora.adapters)), torch.float32, pin) if lora is not None else None
        )

        self.captured = capture
        if capture:
            # Every segment warms up before any is captured, each on the previous one's
            # real output: a capture runs nothing, so its output buffer holds no values yet,
            # and a warm-up on such garbage could write NaN K/V (into the scratch slot).
            hidden: torch.Tensor | None = None
            for seg in self.segments:
                if hidden is not None:
                    # Owned by the segment for the graph's lifetime: its replays read it.
                    seg.hidden = torch.empty_like(hidden, device=seg.device)
                    seg.hidden.copy_(hidden)
                hidden = seg.warm_up()
            for seg in self.segments:
                seg.capture(pools.get(seg.device) if pools else None)

    @property
    def device_rows(self) -> torch.Tensor:
        """The first segment's device rows [batch_size, width]. (Tensor-parallel ranks
        other than 0 receive them instead of staging them; their models are one segment.)"""
        assert len(self.segments) == 1, "device_rows of a multi-segment graph"
        return self.segments[0].device_rows

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured graph of a one-segment model (tools/profile_decode.py replays it)."""
        assert len(self.segments) == 1, "a multi-segment graph has one graph per segment"
        return self.segments[0].graph

    @property
    def lora_batch(self) -> LoraBatch | None:
        """The first segment's static LoRA batch (each segment owns one on its device)."""
        return self.segments[0].lora_batch

    @property
    def lora_scales(self) -> torch.Tensor | None:
        """The first segment's static [batch_size, slots] LoRA scale buffer (device)."""
        return self.lora_batch.body.scales if self.lora_batch is not None else None

    def stage(
        self,
        sequences: list[Sequence],
        tokens: list[int],
        lora_scales: torch.Tensor | None = None,
    ) -> None:
        """Write the step's inputs into every segment's device rows and, in a LoRA graph,
        the rows' adapter scales [len(sequences), slots] into every segment's static scale
        buffer (padding rows: 0, no adapter)."""
        n = len(sequences)
        if n > self.batch_size:
            raise ValueError(f"{n} sequences do not fit the graph of bucket {self.batch_size}")
        self._wait_copies()
        if self.lora_host is not None:
            self.lora_host.zero_()
            if lora_scales is not None:
                if lora_scales.shape != (n, self.lora_host.shape[1]):
                    raise ValueError(
                        f"LoRA scales of shape {tuple(lora_scales.shape)} given to a decode "
                        f"graph captured for {self.lora_host.shape[1]} adapter slots and {n} "
                        "rows: the adapters changed since the capture (a stale graph)"
                    )
                self.lora_host[:n] = lora_scales
            for seg in self.segments:
                assert seg.lora_batch is not None
                seg.lora_batch.body.scales.copy_(self.lora_host, non_blocking=True)
        elif lora_scales is not None:
            raise ValueError("LoRA scales given to a decode graph captured without LoRA")
        self._stage_rows(sequences, [[t] for t in tokens])

    def stage_many(self, sequences: list[Sequence], new_tokens: list[list[int]]) -> None:
        """Write the inputs of a step of up to `tokens_per_row` new tokens per sequence
        (no LoRA). The caller has reserved the pages and advanced each sequence's length
        past its new tokens; rows are padded (see the module docstring)."""
        if len(sequences) > self.batch_size:
            raise ValueError(
                f"{len(sequences)} sequences do not fit the graph of bucket {self.batch_size}"
            )
        self._wait_copies()
        self._stage_rows(sequences, new_tokens)

    def set_tokens(self, tokens: torch.Tensor) -> None:
        """Overwrite the staged rows' first tokens with `tokens` [n] from a device (a
        one-token-per-row graph; call after `stage`)."""
        assert self.tokens_per_row == 1, "device tokens feed one-token rows"
        first = self.segments[0]
        first.device_rows[: tokens.numel(), 0].copy_(tokens, non_blocking=True)

    def _wait_copies(self) -> None:
        for event in self._copied.values():
            event.synchronize()

    def _stage_rows(self, sequences: list[Sequence], new_tokens: list[list[int]]) -> None:
        stage_rows(self.host, sequences, new_tokens, self.tokens_per_row, self.page_size,
                   self.scratch_slot)  # fmt: skip
        for seg in self.segments:
            seg.device_rows.copy_(self.host, non_blocking=True)
            event = self._copied.get(seg.device)
            if event is not None:
                event.record(torch.cuda.current_stream(seg.device))

    def replay(self) -> torch.Tensor:
        """Run the captured forward on what the device rows hold; logits
        [batch_size * tokens_per_row, vocab] on the last segment's device."""
        self.replays += 1
        out: torch.Tensor | None = None
        for seg in self.segments:
            if out is not None:
                if seg.hidden is None:  # uncaptured: sized by the first step's output
                    seg.hidden = torch.empty_like(out, device=seg.device)
                # Device to device: torch orders it after the previous segment's replay (the
                # source device's stream) and this segment's replay after it.
                seg.hidden.copy_(out, non_blocking=True)
            out = seg.replay()
        assert out is not None
        return out


def _host(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    host = torch.zeros(shape, dtype=dtype)
    return host.pin_memory() if pin else host


class DecodeGraphs:
    """Captured decode forwards, one per bucket, made on first use (`capture=False`: the
    same static buffers run eagerly, see the module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        max_seq_len: int,
        *,
        capture: bool = True,
        split_at: Collection[int] = (),
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.model = model
        # Prompt graphs go up to the bucket that holds this many tokens (a prefill chunk).
        self.max_prompt_tokens = max_prompt_tokens
        self.capture = capture
        self.cache = cache
        self.max_pages = -(-max_seq_len // cache.page_size)
        self.max_context = max_seq_len
        # One segment per device of a layer split (plus cuts before the layers `split_at`
        # names, which tests use to run a one-device model as several segments).
        self.segments = plan_segments(model, split_at)
        if capture and any(s.device.type != "cuda" for s in self.segments):
            raise ValueError("decode graphs are captured on CUDA devices only (capture=False)")
        self._graphs: dict[tuple[int, int], _Graph] = {}  # (rows, tokens per row)
        # Graphs with LoRA kernels, valid while the adapters' stacks stay where they were.
        self._lora_graphs: dict[tuple[int, int], _Graph] = {}
        self._lora_version = -1
        self.lora_steps = 0  # decode steps that ran a LoRA graph (benchmarks, tests)
        self._prompt_graphs: dict[int, _Graph] = {}  # tokens (a PROMPT_BUCKETS entry)
        # One memory pool per device for all prompt graphs (see the module docstring).
        self._prompt_pools: dict[torch.device, _POOL_HANDLE] = {}
        self.prompt_steps = 0  # prefills that ran a prompt graph (benchmarks, tests)
        # Device memory the captures took (their private pools, the static buffers): graphs
        # are captured on first use, so a server's memory grows with the shapes it meets.
        self.captured_bytes = 0

    @staticmethod
    def bucket(batch_size: int) -> int | None:
        return next((b for b in BUCKETS if b >= batch_size), None)

    def multi_token_shape(
        self, sequences: list[Sequence], new_tokens: list[list[int]]
    ) -> tuple[int, int] | None:
        """(rows, tokens per row) of the graph that can run this step, or None: every row
        has 1..8 new tokens, rows * tokens fit MAX_GRAPH_TOKENS, and the padded rows stay
        inside the page table."""
        longest = max((len(t) for t in new_tokens), default=0)
        if min((len(t) for t in new_tokens), default=0) < 1:
            return None
        T = next((t for t in TOKEN_BUCKETS if t >= longest), None)
        B = self.bucket(len(sequences))
        if T is None or B is None or B * T > MAX_GRAPH_TOKENS:
            return None
        room = self.max_pages * self.cache.page_size
        if any(seq.length + T > room for seq in sequences):
            return None
        return B, T

    def prompt_bucket(self, sequences: list[Sequence], new_tokens: list[list[int]]) -> int | None:
        """The tokens of the prompt graph that can run this forward, or None: one sequence
        with nothing cached yet, more new tokens than the multi-token graphs take, at most
        PROMPT_BUCKETS[-1], and the padded row inside the page table."""
        if len(sequences) != 1 or sequences[0].length != 0:
            return None
        n = len(new_tokens[0])
        if n <= TOKEN_BUCKETS[-1]:
            return None
        return next((t for t in self.prompt_buckets() if t >= n), None)

    def forward_prompt(self, seq: Sequence, tokens: list[int], bucket: int) -> torch.Tensor:
        """The logits [1, vocab] of a fresh prompt's last token (`prompt_bucket` gave
        `bucket`), through the prompt graph of that many tokens."""
        # Out of the shared pool before another prompt graph can overwrite it.
        return self.stage_prompt(seq, tokens, bucket).replay().clone()

    def stage_prompt(self, seq: Sequence, tokens: list[int], bucket: int) -> _Graph:
        """`forward_prompt` up to its replay: the sequence advanced, the bucket's prompt
        graph (captured now if new) with the prompt in its device rows (which tensor
        parallelism broadcasts before the replay)."""
        self._advance([seq], [len(tokens)])
        graph = self.prompt_graph(bucket)
        graph.stage_many([seq], [tokens])
        self.prompt_steps += 1
        return graph

    def prompt_graph(self, bucket: int) -> _Graph:
        """The prompt graph of `bucket` tokens, captured on first use."""
        graph = self._prompt_graphs.get(bucket)
        if graph is None:
            if self.capture:
                for s in self.segments:
                    if s.device not in self._prompt_pools:
                        self._prompt_pools[s.device] = torch.cuda.graph_pool_handle()
            graph = self._prompt_graphs[bucket] = self._new_graph(
                1, None, bucket, prompt=True, pools=self._prompt_pools
            )
        return graph

    def forward_many(
        self,
        sequences: list[Sequence],
        new_tokens: list[list[int]],
        shape: tuple[int, int],
        logits_counts: list[int] | None = None,
    ) -> torch.Tensor:
        """A step of a few tokens per sequence (`multi_token_shape` gave `shape`): the
        logits of each sequence's last `logits_counts[b]` new tokens (default 1), in order,
        as ModelRunner.forward returns them."""
        graph = self.stage_many(sequences, new_tokens, shape)
        return self.many_logits(graph.replay(), new_tokens, shape, logits_counts)

    def stage_many(
        self, sequences: list[Sequence], new_tokens: list[list[int]], shape: tuple[int, int]
    ) -> _Graph:
        """`forward_many` up to its replay: the sequences advanced, the graph of `shape`
        (captured now if new) with the step's inputs in its device rows."""
        B, T = shape
        self._advance(sequences, [len(t) for t in new_tokens])
        graph = self.graph(B, tokens_per_row=T)
        graph.stage_many(sequences, new_tokens)
        return graph

    @staticmethod
    def many_logits(
        logits: torch.Tensor,
        new_tokens: list[list[int]],
        shape: tuple[int, int],
        logits_counts: list[int] | None = None,
    ) -> torch.Tensor:
        """The rows `forward_many` returns out of its graph's logits [B * T, vocab]."""
        T = shape[1]
        if T == 1:
            return logits[: len(new_tokens)]
        rows: list[int] = []
        for b, tokens in enumerate(new_tokens):
            keep = min(logits_counts[b] if logits_counts else 1, len(tokens))
            rows.extend(range(b * T + len(tokens) - keep, b * T + len(tokens)))
        index = torch.tensor(rows, dtype=torch.int64)
        if logits.device.type == "cuda":
            index = index.pin_memory().to(logits.device, non_blocking=True)
        return logits[index]

    def decode(
        self,
        sequences: list[Sequence],
        tokens: list[int] | torch.Tensor,
        *,
        lora: LoraManager | None = None,
        lora_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step: logits [len(sequences), vocab] (float32). `tokens` are the rows'
        inputs: host ints, or int64 [len(sequences)] on the device, drawn by the last
        step's sampler and not read back (the host stages everything else and they are
        copied into the graph's rows on the device, after the rows' upload in stream
        order). With `lora`, the rows' adapter scales `lora_scales` [len(sequences), slots]
        (CPU) go into a LoRA graph."""
        graph = self.stage_decode(sequences, tokens, lora=lora, lora_scales=lora_scales)
        return graph.replay()[: len(sequences)]

    def stage_decode(
        self,
        sequences: list[Sequence],
        tokens: list[int] | torch.Tensor,
        *,
        lora: LoraManager | None = None,
        lora_scales: torch.Tensor | None = None,
    ) -> _Graph:
        """`decode` up to its replay: the sequences advanced, the bucket's graph (captured
        now if new) with the step's inputs in its device rows. Device tokens are written
        into the rows on the device, behind the staged rows' upload (the host rows keep
        a placeholder 0): tensor parallelism broadcasts those rows before the replay."""
        n = len(sequences)
        self._advance(sequences, [1] * n)
        size = self.bucket(n)
        assert size is not None, "more sequences than the largest bucket"
        graph = self.graph(size, lora)
        if lora is not None:
            self.lora_steps += 1
        if isinstance(tokens, torch.Tensor):
            graph.stage(sequences, [0] * n, lora_scales)
            graph.set_tokens(tokens)
        else:
            graph.stage(sequences, tokens, lora_scales)
        return graph

    def _advance(self, sequences: list[Sequence], counts: list[int]) -> None:
        """Reserve pages for each sequence's new tokens and move its length past them (the
        graph's forward fills those slots)."""
        for seq, count in zip(sequences, counts, strict=True):
            seq.reserve(self.cache, seq.length + count)
            seq.length += count

    def graph(
        self, size: int, lora: LoraManager | None = None, *, tokens_per_row: int = 1
    ) -> _Graph:
        """The captured forward of bucket `size` with `tokens_per_row` new tokens per row
        (with LoRA kernels when `lora` is given: one token per row), captured on first use."""
        graphs = self._graphs
        key = (size, tokens_per_row)
        if lora is not None:
            assert tokens_per_row == 1, "LoRA graphs take one token per row"
            if lora.version != self._lora_version:
                self._lora_graphs.clear()  # they read stacks that no longer exist
                self._lora_version = lora.version
            graphs = self._lora_graphs
        graph = graphs.get(key)
        if graph is None:
            graph = graphs[key] = self._new_graph(size, lora, tokens_per_row)
        # A LoRA graph replays only against the stacks it was captured with.
        assert lora is None or graph.lora_version == lora.version, "stale LoRA graph"
        return graph

    def _new_graph(
        self,
        size: int,
        lora: LoraManager | None,
        tokens_per_row: int,
        *,
        prompt: bool = False,
        pools: dict[torch.device, _POOL_HANDLE] | None = None,
    ) -> _Graph:
        """A graph captured now (static buffers only with capture=False), its memory
        counted in `captured_bytes`."""
        before = self._allocated()
        graph = _Graph(
            self.model,
            self.cache,
            size,
            self.max_pages,
            self.max_context,
            self.segments,
            lora,
            tokens_per_row,
            capture=self.capture,
            prompt=prompt,
            pools=pools,
        )
        self.captured_bytes += self._allocated() - before
        return graph

    def _allocated(self) -> int:
        devices = {s.device for s in self.segments if s.device.type == "cuda"}
        return sum(torch.cuda.memory_allocated(d) for d in devices)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, tokens per row) a graph can be captured for."""
        return [(b, t) for t in TOKEN_BUCKETS for b in BUCKETS if b * t <= MAX_GRAPH_TOKENS]

    def prompt_buckets(self) -> list[int]:
        """Every prompt graph's tokens that fits the page table, up to the bucket holding
        `max_prompt_tokens` (no longer chunk comes)."""
        room = self.max_pages * self.cache.page_size
        top = prompt_bucket_of(self.max_prompt_tokens or PROMPT_BUCKETS[-1])
        return [t for t in PROMPT_BUCKETS if t <= room and t <= top]

    def capture_all(self) -> None:
        """Capture every shape now (no LoRA), e.g. before a server measures its memory:
        otherwise each new shape a step meets allocates its graph's pool then."""
        for size, tokens in self.shapes():
            self.graph(size, tokens_per_row=tokens)
        for bucket in self.prompt_buckets():
            self.prompt_graph(bucket)

    def drop_lora_graphs(self) -> None:
        """Free the LoRA graphs (and their memory pools) now; they are captured again
        when a LoRA decode step next needs them."""
        self._lora_graphs.clear()

    def release(self) -> dict[str, int]:
        """Drop every graph, destroying each captured CUDA graph now: how many graphs were
        dropped (`graphs_dropped`) and how many CUDA graphs destroyed (`graphs_reset`). A
        graph that captured an NCCL collective keeps its communicator from being destroyed
        until the graph itself is (NCCL waits for its graphs in ncclCommDestroy): a
        tensor-parallel rank that left the group while something still held one of its
        graphs waited there until it was killed."""
        dropped = reset = 0
        for graphs in (self._graphs, self._lora_graphs, self._prompt_graphs):
            for graph in graphs.values():
                dropped += 1
                for seg in graph.segments:
                    if seg.graph is not None:
                        torch.cuda.synchronize(seg.device)  # its pool is freed with it
                        seg.graph.reset()
                        seg.graph = None  # a replay of a graph still held runs eagerly
                        reset += 1
            graphs.clear()
        return {"graphs_dropped": dropped, "graphs_reset": reset}
