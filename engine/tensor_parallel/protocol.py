"""What rank 0 tells the other ranks each step (torch.distributed broadcasts from rank 0).

Rank 0 owns the tokenizer, the scheduler and the page bookkeeping; the other ranks only
hold their shard of the weights and of the KV cache and run whatever forward rank 0 runs.
Each step is a fixed-size header (the command and the sizes) then, for a forward, one
int64 payload with the batch's index tensors; for a graph decode, the graph's input rows.
Both live on the rank's device (NCCL needs GPU tensors; gloo takes CPU ones).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.cache import ForwardBatch

FORWARD, GRAPH_DECODE, STOP = 1, 2, 3
HEADER = 8


def _broadcast_header(values: list[int], device: torch.device) -> None:
    header = torch.tensor(values + [0] * (HEADER - len(values)), dtype=torch.int64)
    dist.broadcast(header.to(device), src=0)


def receive_header(device: torch.device) -> list[int]:
    header = torch.zeros(HEADER, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    return header.tolist()


def send_stop(device: torch.device) -> None:
    _broadcast_header([STOP], device)


def send_batch(batch: ForwardBatch, device: torch.device) -> None:
    """Rank 0: announce a forward and send its batch."""
    num_tokens = batch.token_ids.numel()
    num_seqs, max_pages = batch.page_table.shape
    num_logits = batch.logits_indices.numel()
    _broadcast_header(
        [FORWARD, num_tokens, num_seqs, max_pages, num_logits, batch.max_query_len,
         batch.max_context_len, int(batch.fresh)],
        device,
    )  # fmt: skip
    payload = torch.cat(
        [
            batch.token_ids.long().cpu(),
            batch.positions.long().cpu(),
            batch.slots.long().cpu(),
            batch.cu_seqlens.long().cpu(),
            batch.context_lens.long().cpu(),
            batch.page_table.long().flatten().cpu(),
            batch.logits_indices.long().cpu(),
        ]
    )
    dist.broadcast(payload.to(device), src=0)


def receive_batch(header: list[int], device: torch.device) -> ForwardBatch:
    """Other ranks: the batch announced by `header` (a FORWARD header)."""
    _, t, b, pages, n, max_q, max_ctx, fresh = header
    sizes = [t, t, t, b + 1, b, b * pages, n]
    payload = torch.zeros(sum(sizes), dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0)
    tokens, positions, slots, cu, lens, table, logits = payload.split(sizes)
    return ForwardBatch(
        token_ids=tokens,
        positions=positions,
        slots=slots,
        cu_seqlens=cu.to(torch.int32),
        context_lens=lens.to(torch.int32),
        page_table=table.view(b, pages).to(torch.int32),
        logits_indices=logits,
        max_query_len=max_q,
        max_context_len=max_ctx,
        fresh=bool(fresh),  # every rank takes the same attention path
    )


def announce_graph_decode(batch_size: int, device: torch.device) -> None:
    """Rank 0: the next step replays (capturing it first if new) the decode graph of
    `batch_size`; its input rows follow through `broadcast_rows`."""
    _broadcast_header([GRAPH_DECODE, batch_size], device)


def broadcast_rows(rows: torch.Tensor) -> None:
    """A decode graph's input rows (device), from rank 0 into every rank's copy."""
    dist.broadcast(rows, src=0)
