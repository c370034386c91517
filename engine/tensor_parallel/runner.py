"""Rank 0's model runner of a tensor-parallel model: each forward is first broadcast to
the other ranks (engine/tensor_parallel/protocol.py), which run the same forward on their
shards; decode steps replay CUDA graphs on every rank in step (all-reduces captured
inside), other steps run eagerly. The runner holds the other ranks (`Ranks`, from
engine/tensor_parallel/launch.py): releasing it stops them and leaves the group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from engine.architectures.base import CausalLM
from engine.cache import ForwardBatch, PagedKVCache, Sequence
from engine.lora.adapter import LoraError
from engine.lora.manager import LoraManager
from engine.runner import ModelRunner
from engine.tensor_parallel import protocol
from engine.tensor_parallel.ranks import Ranks, leave_group, stop_workers


class TensorParallelRunner(ModelRunner):
    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        loras: LoraManager,
        *,
        ranks: Ranks,
        **options: Any,
    ) -> None:
        super().__init__(model, cache, loras, **options)
        self.ranks = ranks
        self.device = ranks.device  # rank 0's

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    @property
    def rank_devices(self) -> list[str]:
        return list(self.ranks.devices)

    @property
    def rank_memory(self) -> list[dict[str, int]]:
        return list(self.ranks.memory)

    def release(self) -> None:
        """Stop the other ranks (they leave their serving loop), let go of this rank's
        shard, wait for the spawned processes to end and leave the group."""
        stopped = False
        if self.model is not None and dist.is_initialized():
            protocol.send_stop(self.device)
            stopped = True
        super().release()
        ranks = self.ranks
        for worker in ranks.workers:
            worker.join(timeout=60)
        stop_workers(ranks.workers)
        if dist.is_initialized():
            if stopped and ranks.launched and dist.get_backend() == "gloo":
                # torchrun's ranks outlive this call: on gloo a rank still tearing down
                # aborts when this process exits first, so the group is left together.
                # (On NCCL, 2xH100, a barrier here hung; the ranks leave as spawned ones do.)
                dist.barrier()
            leave_group(launched=ranks.launched)

    def abort(self) -> None:
        """Stop the other ranks without a collective (after a failed step they may be stuck
        inside one): terminate their processes and drop the process group."""
        stop_workers(self.ranks.workers)
        self.graphs = None  # their replays would wait on the stopped ranks
        super().release()
        if dist.is_initialized():
            dist.destroy_process_group()

    def forward(
        self,
        sequences: list[Sequence],
        new_tokens: list[list[int]],
        *,
        all_logits: bool = False,
        logits_counts: list[int] | None = None,
        loras: list[dict[str, float]] | None = None,
    ) -> torch.Tensor:
        """As ModelRunner.forward; `logits_counts` (speculative verification, logits jobs)
        sends the rows to keep in the batch's logits_indices, so the other ranks need
        nothing new. LoRA adapters are not sent to the other ranks yet: a selection is
        refused."""
        if any(loras or []) or self.loras.default:
            raise LoraError("LoRA adapters are not supported with tensor parallelism yet")
        graphs = self.graphs
        if (
            graphs is not None
            and not all_logits
            and logits_counts is None
            and all(len(t) == 1 for t in new_tokens)
            and graphs.bucket(len(sequences)) is not None
        ):
            size = graphs.bucket(len(sequences))
            assert size is not None
            for seq in sequences:
                seq.reserve(self.cache, seq.length + 1)
                seq.length += 1
            # Header first: the other ranks capture a new bucket's graph in step with us.
            protocol.announce_graph_decode(size, self.device)
            graph = graphs.graph(size)
            graph.stage(sequences, [t[0] for t in new_tokens])
            protocol.broadcast_rows(graph.device_rows)  # rank 0 is the source
            return graph.replay()[: len(sequences)]
        batch = ForwardBatch.build(
            self.cache, sequences, new_tokens, all_logits=all_logits, logits_counts=logits_counts
        )
        protocol.send_batch(batch, self.device)
        logits: torch.Tensor = self.model(batch.on(self.device), self.cache)
        return logits

    def forward_decode_tokens(
        self, sequences: list[Sequence], tokens: torch.Tensor
    ) -> torch.Tensor:
        """The lookahead's decode step: the tokens are read back and broadcast with the
        step (the other ranks' graphs take host rows)."""
        n = len(sequences)
        return self.forward(sequences, [[t] for t in tokens.tolist()], loras=[{}] * n)
