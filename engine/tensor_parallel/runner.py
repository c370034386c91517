"""Rank 0's model runner of a tensor-parallel model: each forward is first announced to
the other ranks (engine/tensor_parallel/protocol.py: headers over a gloo group on the
host, a decode graph's rows over the default group on the device), which run the same
forward on their shards; decode steps replay CUDA graphs on every rank in step
(all-reduces captured inside), other steps run eagerly. The lookahead's decode steps keep
their tokens on the device (`forward_decode_tokens`): nothing in a graph decode step
waits for a GPU, on any rank. The runner holds the other ranks (`Ranks`, from
engine/tensor_parallel/launch.py): releasing it stops them and leaves the group.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist

from engine.architectures.base import CausalLM
from engine.cache import ForwardBatch, PagedKVCache, Sequence
from engine.cuda_graph import DecodeGraphs
from engine.lora.adapter import LoraError
from engine.lora.manager import LoraManager
from engine.runner import ModelRunner
from engine.tensor_parallel.errors import RankFailedError, TensorParallelError
from engine.tensor_parallel.leave import LEAVE_TIMEOUT_S, leave_group, released_graphs
from engine.tensor_parallel.ranks import Ranks, stop_workers


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
        self.channel = ranks.channel
        # Set when a step failed on this rank after the other ranks were sent it: they are
        # out of step with it, so the engine stops and every later call says why.
        self.broken: str | None = None
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
        graphs and shard, leave the group together with the other ranks (leave.py: they
        let go of theirs first), then wait for the spawned processes to end."""
        ranks = self.ranks
        stopped = False
        if self.model is not None and dist.is_initialized():
            try:
                self.channel.send_stop()
                stopped = True
            except (RuntimeError, ValueError):
                pass  # a rank is gone already: the others are stopped below
        self.stop_lora_graph_listener()
        report = released_graphs(self)
        super().release()
        if dist.is_initialized():
            if stopped:
                ranks.left = leave_group(self.channel, report) or []
            else:  # no meeting: a rank that stopped would never come
                stop_workers(ranks.workers)
                dist.destroy_process_group()
        for worker in ranks.workers:
            # They end right after leaving; the timeout is for one that hangs in its exit.
            worker.join(timeout=LEAVE_TIMEOUT_S)
        ranks.terminated = [r for r, w in enumerate(ranks.workers, start=1) if w.is_alive()]
        stop_workers(ranks.workers)

    def abort(self) -> None:
        """Stop the other ranks without a collective (after a failed step they may be stuck
        inside one): terminate their processes and drop the process group."""
        stop_workers(self.ranks.workers)
        self.graphs = None  # their replays would wait on the stopped ranks
        super().release()
        if dist.is_initialized():
            dist.destroy_process_group()

    def enable_decode_graphs(
        self, *, capture: bool = True, split_at: Collection[int] = ()
    ) -> DecodeGraphs:
        """Decode graphs on every rank (`capture=False`: their static buffers run
        eagerly, which is how the CPU tests take the graph decode path)."""
        if self.graphs is not None:
            raise RuntimeError("decode graphs are already enabled on this engine")
        if split_at:
            raise TensorParallelError("a tensor-parallel rank's graph is one segment")
        self._send(lambda: self.channel.announce_graphs(capture))
        self.graphs = DecodeGraphs(self.model, self.cache, self.max_seq_len, capture=capture)
        return self.graphs

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
        self._check_in_step()
        if any(loras or []) or self.loras.default:
            raise LoraError("LoRA adapters are not supported with tensor parallelism yet")
        if (
            not all_logits
            and logits_counts is None
            and all(len(t) == 1 for t in new_tokens)
            and self.decode_graph_fits(sequences)
        ):
            return self.graph_decode(sequences, [t[0] for t in new_tokens])
        if self.graphs is not None and not all_logits:
            logits = self._graph_forward(sequences, new_tokens, logits_counts)
            if logits is not None:
                return logits
        batch = ForwardBatch.build(
            self.cache, sequences, new_tokens, all_logits=all_logits, logits_counts=logits_counts
        )
        self._send(lambda: self.channel.send_batch(batch))
        return self._step(lambda: self.model(batch.on(self.device), self.cache))

    # forward_decode_tokens is ModelRunner's: through `graph_decode` below when a decode
    # graph fits (the tokens stay on the device), else eagerly from the read-back tokens.

    def graph_decode(
        self, sequences: list[Sequence], tokens: list[int] | torch.Tensor
    ) -> torch.Tensor:
        """One decode step through every rank's decode graph of its bucket. The header goes
        first (host, gloo), so that a new bucket's graph is captured on every rank in step;
        then the rows staged here (device `tokens` written into them on the device, never
        read back) are broadcast into the other ranks' graph rows on the stream, and every
        rank replays."""
        self._check_in_step()
        graphs = self.graphs
        assert graphs is not None
        size = graphs.bucket(len(sequences))
        assert size is not None
        for seq in sequences:  # pages first: a full cache then fails before any rank starts
            seq.reserve(self.cache, seq.length + 1)
        self._send(lambda: self.channel.announce_graph_decode(size))

        def step() -> torch.Tensor:
            graph = graphs.stage_decode(sequences, tokens)
            self.channel.broadcast_rows(graph.device_rows)  # rank 0 is the source
            return graph.replay()[: len(sequences)]

        return self._step(step)

    def _graph_forward(
        self,
        sequences: list[Sequence],
        new_tokens: list[list[int]],
        logits_counts: list[int] | None,
    ) -> torch.Tensor | None:
        """A step of a few tokens per row, or a fresh prompt, through a graph on every rank
        (as ModelRunner.forward takes them on one device), or None when none fits. Eager,
        a prompt pays the host's launch of every kernel on every rank: 512 tokens of an
        8B model prefilled at a quarter of one GPU's speed."""
        graphs = self.graphs
        assert graphs is not None
        shape = graphs.multi_token_shape(sequences, new_tokens)
        bucket = None
        if shape is None and logits_counts is None:
            bucket = graphs.prompt_bucket(sequences, new_tokens)
        if shape is None and bucket is None:
            return None
        for seq, tokens in zip(sequences, new_tokens, strict=True):
            seq.reserve(self.cache, seq.length + len(tokens))  # a full cache fails here
        if shape is not None:
            B, T = shape
            self._send(lambda: self.channel.announce_graph_many(B, T))

            def many() -> torch.Tensor:
                graph = graphs.stage_many(sequences, new_tokens, (B, T))
                self.channel.broadcast_rows(graph.device_rows)
                return graphs.many_logits(graph.replay(), new_tokens, (B, T), logits_counts)

            return self._step(many)
        assert bucket is not None
        self._send(lambda: self.channel.announce_graph_prompt(bucket))

        def prompt() -> torch.Tensor:
            graph = graphs.stage_prompt(sequences[0], new_tokens[0], bucket)
            self.channel.broadcast_rows(graph.device_rows)
            # Out of the shared pool before another prompt graph can overwrite it.
            return graph.replay().clone()

        return self._step(prompt)

    def _check_in_step(self) -> None:
        """After a step that left the ranks out of step (they were stopped), say why."""
        if self.broken is not None:
            raise RankFailedError(self.broken)

    def _send(self, message: Callable[[], None]) -> None:
        """Run `message`, a control-plane send. It fails at once when a rank has stopped
        (its links closed with its process): raised as a RankFailedError with what is
        known of the failed ranks."""
        self._check_in_step()
        try:
            message()
        except RuntimeError as error:
            known = self.ranks.failures() or "see the other ranks' logs"
            raise RankFailedError(
                f"a tensor-parallel rank stopped answering ({known}): "
                f"{type(error).__name__}: {error}"
            ) from error

    def _step(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run this rank's share of a step, whose header the other ranks already have. Any
        error here leaves the ranks out of step (the others queued the whole step's
        collectives, this rank only some), and a later collective would pair with another
        rank's different one: a hang or wrong tokens. So the other ranks are stopped and
        the error is a RankFailedError, naming a failed rank's error where one is known.
        (Running out of memory too: the scheduler's undo of a lookahead step cannot undo
        what the other ranks have queued.)"""
        try:
            return run()
        except Exception as error:
            known = self.ranks.failures()
            cause = f"{type(error).__name__}: {error}"
            if known:
                self.broken = f"a tensor-parallel rank failed during a step ({known}): {cause}"
            else:
                self.broken = (
                    "a tensor-parallel step failed on rank 0 after the other ranks had started "
                    f"it, so they were stopped; load the model again ({cause})"
                )
            self.abort()
            raise RankFailedError(self.broken) from error
