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


def batch_header(batch: ForwardBatch) -> list[int]:
    """The FORWARD header of `batch`: the sizes of its payload and its host-side fields."""
    num_seqs, max_pages = batch.page_table.shape
    return [FORWARD, batch.token_ids.numel(), num_seqs, max_pages, batch.logits_indices.numel(),
            batch.max_query_len, batch.max_context_len, int(batch.fresh)]  # fmt: skip


def batch_payload(batch: ForwardBatch) -> torch.Tensor:
    """The batch's index tensors as one int64 vector (CPU), in the header's sizes."""
    return torch.cat(
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


def _payload_sizes(header: list[int]) -> list[int]:
    _, t, b, pages, n = header[:5]
    return [t, t, t, b + 1, b, b * pages, n]


def batch_from(header: list[int], payload: torch.Tensor) -> ForwardBatch:
    """The ForwardBatch that `batch_header` and `batch_payload` describe."""
    _, t, b, pages, n, max_q, max_ctx, fresh = header
    tokens, positions, slots, cu, lens, table, logits = payload.split(_payload_sizes(header))
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


def send_batch(batch: ForwardBatch, device: torch.device) -> None:
    """Rank 0: announce a forward and send its batch."""
    _broadcast_header(batch_header(batch), device)
    dist.broadcast(batch_payload(batch).to(device), src=0)


def receive_batch(header: list[int], device: torch.device) -> ForwardBatch:
    """Other ranks: the batch announced by `header` (a FORWARD header)."""
    payload = torch.zeros(sum(_payload_sizes(header)), dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0)
    return batch_from(header, payload)


def announce_graph_decode(batch_size: int, device: torch.device) -> None:
    """Rank 0: the next step replays (capturing it first if new) the decode graph of
    `batch_size`; its input rows follow through `broadcast_rows`."""
    _broadcast_header([GRAPH_DECODE, batch_size], device)


def broadcast_rows(rows: torch.Tensor) -> None:
    """A decode graph's input rows (device), from rank 0 into every rank's copy."""
    dist.broadcast(rows, src=0)
