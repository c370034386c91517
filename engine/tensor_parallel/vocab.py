"""Vocabulary-parallel embeddings and head: each rank keeps 1/W of the vocabulary's rows.

A replicated embedding table and head cost every rank 2 x vocab x hidden x 2 bytes (4.2 GB
for Llama-3-70B in fp16), and a replicated fp16 head is the largest single read of a
70B 4-bit decode step (2.1 GB per token on every rank). Cut by vocabulary rows instead:

- rank r keeps rows [r*S, min((r+1)*S, V)) of both, S = ceil(V / W) (`vocab_range`);
- the embedding looks up the ids inside its range, zeroes the rows of the others and the
  ranks sum (all-reduce) the rows: each id is held by exactly one rank, so the sum is its
  row, bit for bit (x + 0 is exact in every float format);
- the head computes the logits of its rows (dense, or quantized: the vocabulary is the
  output axis, which is never packed, so the cut is exact: shard.py), pads them to S columns
  (the last rank's range can be shorter) and the ranks all-gather the slices: every rank
  ends with the logits [N, V] one process computes, each column from the same dot product.

Shapes are fixed per step and nothing syncs with the host, so both run inside the decode
CUDA graphs. A tied head shares its rows with the embedding slice, as it shares the whole
table in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.architectures.base import CausalLM
from engine.linears import linear_features
from engine.lora.batch import LoraBatch
from engine.modules import Linear
from engine.quantized_linear import QuantizedLinear
from engine.tensor_parallel.all_reduce import GroupAllReduce
from engine.tensor_parallel.errors import TensorParallelError
from engine.tensor_parallel.shard import shard_columns

# Up to this many tokens the embedding rows are summed in float32 (exact: one rank's row plus
# zeros), which takes the one-shot all-reduce at decode (all_reduce.py); prefill sums in the
# table's dtype.
FLOAT32_SUM_MAX_TOKENS = 64


@dataclass(frozen=True)
class LoadedVocab:
    """The whole model's sizes, for a rank whose load read only its vocabulary rows: the
    embedding table's rows and the head's outputs (either may be padded beyond vocab_size)."""

    table_rows: int
    head_vocab: int


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [lo, hi) of a vocabulary of `vocab` that `rank` of `world` keeps."""
    per_rank = -(-vocab // world)
    lo, hi = rank * per_rank, min((rank + 1) * per_rank, vocab)
    if hi <= lo:
        raise TensorParallelError(
            f"a vocabulary of {vocab} tokens leaves rank {rank} of {world} no rows"
        )
    return lo, hi


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the embedding table; forward returns whole rows for any id."""

    def __init__(self, weight: torch.Tensor, lo: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [hi - lo, hidden]
        self.lo = lo
        self.group = group
        self.reduce: GroupAllReduce | None = None  # use_all_reduce (transform.py) sets it

    def forward(self, token_ids: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """`lora`: as every embedding takes it; LoRA under tensor parallelism is refused."""
        local = token_ids - self.lo
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        rows = rows.masked_fill(~inside.unsqueeze(-1), 0)
        dtype = rows.dtype
        if token_ids.numel() <= FLOAT32_SUM_MAX_TOKENS:
            rows = rows.float()
        rows = rows.contiguous()
        if self.reduce is not None:
            rows = self.reduce(rows)
        else:
            dist.all_reduce(rows, group=self.group)
        return rows.to(dtype)


class VocabParallelHead(nn.Module):
    """The head's output columns [lo, hi) (`inner`, a Linear or QuantizedLinear), gathered
    from every rank into the logits of the whole vocabulary."""

    def __init__(
        self, inner: nn.Module, *, world: int, vocab: int, group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.inner = inner
        self.world, self.vocab, self.group = world, vocab, group
        self.per_rank = -(-vocab // world)
        self.in_features = linear_features(inner)[0]
        self.out_features = vocab

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        part: torch.Tensor = self.inner(x)  # [N, hi - lo]
        short = self.per_rank - part.shape[-1]
        if short:
            part = F.pad(part, (0, short))
        part = part.contiguous()
        gathered = part.new_empty(self.world * part.shape[0], self.per_rank)  # [W*N, S]
        _all_gather(gathered, part, self.group)
        # [W, N, S] -> [N, W*S]: rank r's columns are vocabulary rows r*S.. of every token.
        logits = gathered.view(self.world, -1, self.per_rank).permute(1, 0, 2)
        return logits.reshape(part.shape[0], -1)[:, : self.vocab]


def _all_gather(out: torch.Tensor, part: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; the
    # GPU image's torch 2.11 has only the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, part, group=group)


def shard_vocab(
    model: CausalLM,
    *,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None = None,
    loaded: LoadedVocab | None = None,
) -> None:
    """Replace `model`'s embeddings and head by this rank's vocabulary rows, in place.
    `loaded`: the load read only those rows and columns (cut_load.py): keep them as they are.
    """
    # The table's and the head's own sizes (a checkpoint may pad either beyond vocab_size).
    embed = model.model.embed_tokens
    table = embed.weight
    if not isinstance(table, torch.Tensor) or table.dim() != 2:
        raise TensorParallelError(f"cannot cut a {type(embed).__name__} by vocabulary rows")
    head = model.lm_head
    if loaded is not None:
        vocab = loaded.head_vocab
        lo, _ = vocab_range(loaded.table_rows, rank, world)
        slice_ = VocabParallelEmbedding(table, lo, group)
        model.model.embed_tokens = slice_
        if isinstance(head, Linear) and head.weight is table:  # tied: the slice's rows
            head.weight = slice_.weight
        model.lm_head = VocabParallelHead(head, world=world, vocab=vocab, group=group)
        return
    lo, hi = vocab_range(table.shape[0], rank, world)
    # A clone: a view of the rows would keep the whole table's storage alive.
    slice_ = VocabParallelEmbedding(table[lo:hi].clone(), lo, group)
    model.model.embed_tokens = slice_
    vocab = linear_features(head)[1]
    if isinstance(head, Linear) and head.weight is table:  # tied
        # One tensor for both, as in one process: the head reads the embedding's rows.
        with torch.device("meta"):  # its parameters are the slice's, not new tensors
            inner: nn.Module = Linear(head.in_features, hi - lo, head.bias is not None)
        inner.weight = slice_.weight
        if head.bias is not None:
            inner.bias = nn.Parameter(head.bias[lo:hi].clone(), requires_grad=False)
    elif isinstance(head, (Linear, QuantizedLinear)):
        lo, hi = vocab_range(vocab, rank, world)
        inner = shard_columns(head, torch.arange(lo, hi))
    else:
        raise TensorParallelError(f"cannot cut a {type(head).__name__} head by vocabulary rows")
    model.lm_head = VocabParallelHead(inner, world=world, vocab=vocab, group=group)
