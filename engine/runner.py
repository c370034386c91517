"""The model runner: everything between a `StepPlan` and the model's output.

`ModelRunner.execute(plan)` is the one way the engine runs its model (generation steps,
logits jobs, embeddings, the single-job session, a draft model's proposals): it owns the
model, the K/V storage, the CUDA graphs (which graph, if any, runs a step), the LoRA batch
of a step and the draft model. It keeps no books: the sequences of a plan come with their
pages' room already accounted for by the scheduler, and `execute` only advances their
lengths past the tokens it writes (`ForwardBatch.build` / the graphs' staging).

Graph selection (`forward`), as engine/cuda_graph.py describes the graphs:
- every row 1..8 tokens, no LoRA: the multi-token graph of B rows x T tokens (decode,
  speculative verification, short chunks);
- one fresh prompt of up to `prefill_chunk` tokens, last logits only, no LoRA: a prompt graph;
- one token per row under LoRA adapters (`lora_graphs`): a LoRA decode graph;
- anything else: the eager forward, with the step's LoRA batch in its `ForwardBatch`.
`forward_decode_tokens` is the lookahead's decode step: its input tokens are on the device
(drawn by the sampler and not read back) and go into the graph's rows device to device.

Tensor parallelism is a runner too (engine/tensor_parallel/runner.py): it holds the other
ranks, broadcasts each step to them before its own forward, and stops them on release.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from engine.architectures.base import CausalLM
from engine.cache import ForwardBatch, PagedKVCache, Sequence
from engine.cuda_graph import DecodeGraphs
from engine.draft_model import DraftModel
from engine.lora import LoraManager
from engine.step import StepOutput, StepPlan
from kernels.argmax import argmax_rows
from kernels.token_bitmask import apply_token_bitmask


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        loras: LoraManager,
        *,
        max_seq_len: int,
        prefill_chunk: int,
        lora_graphs: bool,
    ) -> None:
        self.model = model
        self.cache = cache
        self.loras = loras
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.graphs: DecodeGraphs | None = None
        # LoRA decode steps replay graphs (when `graphs` exist); tools/bench_lora.py flips it
        # between measurements to compare with eager LoRA steps on one engine.
        self.lora_graphs = lora_graphs
        self.draft: DraftModel | None = None  # speculative="draft": proposes in `execute`

    @property
    def logits_device(self) -> torch.device:
        return self.model.lm_head_device

    @property
    def world_size(self) -> int:
        """Ranks that each hold a shard of the model (tensor parallelism); 1: the whole."""
        return 1

    @property
    def rank_devices(self) -> list[str]:
        """Every rank's device under tensor parallelism; none otherwise."""
        return []

    @property
    def rank_memory(self) -> list[dict[str, int]]:
        """What each tensor-parallel rank held once loaded (rank.rank_memory); none
        otherwise."""
        return []

    def apply_token_bitmask(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        with torch.inference_mode():  # the forward's logits are inference tensors
            return apply_token_bitmask(logits, bitmask, rows)

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        # Two kernels on a GPU (kernels/argmax.py): torch's argmax of a 128k vocabulary
        # takes one thread block, 29 us of an 8B decode step on an H200.
        with torch.inference_mode():
            return argmax_rows(logits)

    # -- the step ------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run `plan`'s forward (see engine/step.py for what each field asks)."""
        if plan.hidden_states:
            return StepOutput(self.hidden_states(plan.sequences, plan.new_tokens, plan.loras))
        if plan.device_tokens is not None:
            return StepOutput(self.forward_decode_tokens(plan.sequences, plan.device_tokens))
        new_tokens, counts = plan.new_tokens, plan.logits_counts
        drafts = None
        if plan.drafts is not None:
            drafts = self._propose(plan)
            if any(drafts):
                new_tokens = [t + d for t, d in zip(new_tokens, drafts, strict=True)]
                counts = [(counts[b] if counts else 1) + len(d) for b, d in enumerate(drafts)]
        logits = self.forward(
            plan.sequences,
            new_tokens,
            all_logits=plan.all_logits,
            logits_counts=counts,
            loras=plan.loras,
        )
        return StepOutput(logits, drafts)

    def _propose(self, plan: StepPlan) -> list[list[int]]:
        assert plan.drafts is not None
        wanted = [(b, r) for b, r in enumerate(plan.drafts) if r is not None]
        drafts: list[list[int]] = [[] for _ in plan.sequences]
        if self.draft is None or not wanted:
            return drafts
        proposed = self.draft.propose(
            [r.sequence for _, r in wanted],
            [r.context for _, r in wanted],
            [r.k for _, r in wanted],
        )
        for (b, _), tokens in zip(wanted, proposed, strict=True):
            drafts[b] = list(tokens)
        return drafts

    # -- forwards ------------------------------------------------------------------------
    def forward(
        self,
        sequences: list[Sequence],
        new_tokens: list[list[int]],
        *,
        all_logits: bool = False,
        logits_counts: list[int] | None = None,
        loras: list[dict[str, float]] | None = None,
    ) -> torch.Tensor:
        """Logits of each sequence's last new token (its last `logits_counts[b]`, or all).

        `loras`: each sequence's resolved LoRA selection (LoraManager.resolve); None gives
        every sequence the model's default selection (set_loras)."""
        if loras is None:
            loras = [self.loras.default] * len(sequences)
        lengths = [len(t) for t in new_tokens]
        lora_scales = self.loras.scales(loras)
        if self.graphs is not None and not all_logits:
            if lora_scales is None:
                # Decode steps, speculative verification and short chunks: a graph of
                # B rows x T tokens (engine/cuda_graph.py).
                shape = self.graphs.multi_token_shape(sequences, new_tokens)
                if shape is not None:
                    return self.graphs.forward_many(sequences, new_tokens, shape, logits_counts)
                # A fresh prompt of up to 2048 tokens: one padded row, last logits only.
                if logits_counts is None:
                    bucket = self.graphs.prompt_bucket(sequences, new_tokens)
                    if bucket is not None:
                        return self.graphs.forward_prompt(sequences[0], new_tokens[0], bucket)
            elif (
                self.lora_graphs
                and logits_counts is None
                and all(n == 1 for n in lengths)
                and self.graphs.bucket(len(sequences)) is not None
                and self.loras.graphable(loras)
            ):
                tokens = [t[0] for t in new_tokens]
                return self.graphs.decode(
                    sequences, tokens, lora=self.loras, lora_scales=lora_scales
                )
        lora_batch = None
        if lora_scales is not None:
            if all_logits:
                logits_lengths = lengths
            elif logits_counts is not None:
                logits_lengths = list(logits_counts)
            else:
                logits_lengths = [min(n, 1) for n in lengths]
            lora_batch = self.loras.batch(lora_scales, lengths, logits_lengths)
        batch = ForwardBatch.build(
            self.cache,
            sequences,
            new_tokens,
            all_logits=all_logits,
            logits_counts=logits_counts,
            lora=lora_batch,
        )
        logits: torch.Tensor = self.model(batch, self.cache)
        return logits

    def forward_decode_tokens(
        self, sequences: list[Sequence], tokens: torch.Tensor
    ) -> torch.Tensor:
        """Logits [len(sequences), vocab] of one decode step whose input tokens (int64
        [len(sequences)]) are on the device, drawn by the last step's sampler and not read
        back: a decode graph takes them device to device, so the host does not wait for
        them. Without a graph for the step (CPU, cuda_graphs=False) they are read back and
        the step runs as `forward` (no LoRA: the default selection is not applied)."""
        n = len(sequences)
        if self.decode_graph_fits(sequences):
            return self.graph_decode(sequences, tokens)
        return self.forward(sequences, [[t] for t in tokens.tolist()], loras=[{}] * n)

    def decode_graph_fits(self, sequences: list[Sequence]) -> bool:
        """Whether a one-token-per-row decode graph (no LoRA) can run this step: graphs
        are on, a bucket holds the rows and each row's next slot is inside the page table."""
        graphs, n = self.graphs, len(sequences)
        return graphs is not None and graphs.multi_token_shape(sequences, [[0]] * n) == (
            graphs.bucket(n),
            1,
        )

    def graph_decode(
        self, sequences: list[Sequence], tokens: list[int] | torch.Tensor
    ) -> torch.Tensor:
        """One decode step through the decode graph of its bucket (`decode_graph_fits`):
        logits [len(sequences), vocab]. `tokens`: host ints or device int64 (not read
        back). Tensor parallelism sends the step to the other ranks around it."""
        assert self.graphs is not None
        return self.graphs.decode(sequences, tokens)

    def hidden_states(
        self,
        sequences: list[Sequence],
        new_tokens: list[list[int]],
        loras: list[dict[str, float]] | None = None,
    ) -> torch.Tensor:
        """Final hidden states [sum of lengths, width] (float32, CPU) of one forward, after
        the final norm, under each row's LoRA selection (None: the model's default)."""
        if loras is None:
            loras = [self.loras.default] * len(sequences)
        lengths = [len(t) for t in new_tokens]
        scales = self.loras.scales(loras)
        lora_batch = None if scales is None else self.loras.batch(scales, lengths, lengths)
        batch = ForwardBatch.build(
            self.cache, sequences, new_tokens, all_logits=True, lora=lora_batch
        )
        return self.model.hidden_states(batch, self.cache).float().cpu()

    def prefill(
        self,
        seq: Sequence,
        token_ids: list[int],
        *,
        all_logits: bool = False,
        loras: dict[str, float] | None = None,
    ) -> torch.Tensor:
        """Feed a prompt in `prefill_chunk` pieces; the last token's logits (or every
        token's). For tools and tests that drive the model without a scheduler."""
        outputs = []
        selection = None if loras is None else [loras]
        for start in range(0, len(token_ids), self.prefill_chunk):
            piece = [token_ids[start : start + self.prefill_chunk]]
            outputs.append(self.forward([seq], piece, all_logits=all_logits, loras=selection))
        return torch.cat(outputs) if all_logits else outputs[-1]

    # -- setup and teardown --------------------------------------------------------------
    def enable_decode_graphs(
        self, *, capture: bool = True, split_at: Collection[int] = ()
    ) -> DecodeGraphs:
        """See Engine.enable_decode_graphs."""
        if self.graphs is not None:
            raise RuntimeError("decode graphs are already enabled on this engine")
        self.graphs = DecodeGraphs(
            self.model,
            self.cache,
            self.max_seq_len,
            capture=capture,
            split_at=split_at,
            max_prompt_tokens=self.prefill_chunk,
        )
        # Loading or unloading an adapter re-allocates the stacks the LoRA graphs read.
        self.loras.listeners.append(self.graphs.drop_lora_graphs)
        return self.graphs

    def abort(self) -> None:
        """Let go at once after a failed step (`release` here; tensor parallelism stops
        its ranks without a collective)."""
        self.release()

    def stop_lora_graph_listener(self) -> None:
        """Stop telling the decode graphs about adapter changes (before they are released)."""
        graphs = self.graphs
        if graphs is not None and graphs.drop_lora_graphs in self.loras.listeners:
            self.loras.listeners.remove(graphs.drop_lora_graphs)

    def release(self) -> None:
        """Let go of the model, its K/V storage, the graphs (their memory pools) and the
        draft model (its engine is unloaded by its owner), so that unloading frees them
        even while something still holds the runner."""
        self.draft = None
        if self.graphs is not None:
            self.stop_lora_graph_listener()
            self.graphs.release()
            self.graphs = None
        self.model = None  # type: ignore[assignment]
        self.cache = None  # type: ignore[assignment]
        self.loras = None  # type: ignore[assignment]
