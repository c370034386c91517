"""What rank 0 tells the other ranks each step, and over which group (`Channel`).

Rank 0 owns the tokenizer, the scheduler and the page bookkeeping; the other ranks only
hold their shard of the weights and of the KV cache and run whatever forward rank 0 runs.

Control plane, on the host: each step starts with a fixed-size int64 header (the command
and the sizes) and, for an eager forward, one int64 payload with the batch's index
tensors. Both are host data, so they go over a gloo group made beside the default one,
from CPU tensors: rank 0 sends them without waiting for its GPU, and a rank > 0 learns
step t+1 on its host while its GPU still runs step t, so it queues the next replay right
behind the last one. (Over NCCL the header had to be copied to the GPU and read back on
every rank: a host wait queued behind the rank's previous replay, once a step.)

Data plane, on the device (the default group: NCCL on GPUs, gloo on the CPU): a graph
decode's input rows, which hold tokens drawn by rank 0's sampler and never read back,
then the forward's own collectives (all-reduces, the logits all-gather) in the graph or
the eager forward. All of it is queued on the stream; no rank's host waits for it.

Why this cannot deadlock: every rank issues the collectives of each group in the same
order (NCCL matches a rank's n-th collective of a communicator with the n-th of every
other rank; a different order pairs unlike operations and hangs, or mixes their data).
The header names the step, and every rank derives the step's data-plane collectives from
it alone (rows broadcast, then the forward's collectives, a new bucket's capture first),
so the data-plane order follows the header order, which gloo delivers in order. Between
the groups: rank 0 queues all of step t's device work before it sends header t+1, so a
rank > 0 whose host waits for its GPU inside step t (an eager forward, a capture) only
waits for collectives that rank 0 has already queued; and rank 0's GPU never waits on
anything its host has yet to do. So the host of each rank can always reach its next
control message, and the GPUs always find their peers' matching collectives.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from engine.cache import ForwardBatch
from engine.samplers.batched import host_to_device

FORWARD, GRAPH_DECODE, STOP, GRAPHS, GRAPH_PROMPT, GRAPH_MANY = 1, 2, 3, 4, 5, 6
HEADER = 8
# A rank > 0 waits for rank 0's next step for as long as the server stays idle, in a gloo
# receive: with the process group's own timeout (30 min by default) an idle server's ranks
# would give up. A year is far below where the wait's deadline would overflow.
CONTROL_TIMEOUT = timedelta(days=365)


class Channel:
    """Rank 0's messages to the other ranks: headers and eager batches over the gloo
    `control` group (host), decode-graph rows over the default group (device)."""

    def __init__(self, control: dist.ProcessGroup, device: torch.device) -> None:
        self.control = control
        self.device = device
        self.headers = 0  # headers sent (rank 0) or received (others)

    @classmethod
    def open(cls, device: torch.device) -> Channel:
        """The channel of this rank: makes the gloo group, a collective of the default
        group, so every rank calls it at the same point (right after joining it)."""
        return cls(dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT), device)

    # -- control plane (host) --------------------------------------------------------
    def _send_header(self, values: list[int]) -> None:
        header = torch.tensor(values + [0] * (HEADER - len(values)), dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        self.headers += 1

    def receive_header(self) -> list[int]:
        header = torch.zeros(HEADER, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        self.headers += 1
        return header.tolist()  # a CPU tensor: no device to wait for

    def send_stop(self) -> None:
        self._send_header([STOP])

    def send_batch(self, batch: ForwardBatch) -> None:
        """Rank 0: announce an eager forward and send its batch (host tensors)."""
        self._send_header(batch_header(batch))
        dist.broadcast(batch_payload(batch), src=0, group=self.control)

    def receive_batch(self, header: list[int]) -> ForwardBatch:
        """Other ranks: the batch announced by `header` (a FORWARD header), on this rank's
        device (copied without waiting for the device)."""
        payload = torch.zeros(sum(_payload_sizes(header)), dtype=torch.int64)
        dist.broadcast(payload, src=0, group=self.control)
        return batch_from(header, host_to_device(payload, self.device))

    def announce_graph_decode(self, batch_size: int) -> None:
        """Rank 0: the next step replays (capturing it first if new) the decode graph of
        `batch_size`; its input rows follow through `broadcast_rows`."""
        self._send_header([GRAPH_DECODE, batch_size])

    def announce_graph_prompt(self, bucket: int) -> None:
        """Rank 0: the next step replays (capturing it first if new) the prompt graph of
        `bucket` tokens (a fresh prompt's prefill); its input rows follow as a decode
        graph's do."""
        self._send_header([GRAPH_PROMPT, bucket])

    def announce_graph_many(self, batch_size: int, tokens_per_row: int) -> None:
        """Rank 0: the next step replays (capturing it first if new) the graph of
        `batch_size` rows of `tokens_per_row` new tokens (a short prompt or chunk, a
        speculative verification); its input rows follow as a decode graph's do."""
        self._send_header([GRAPH_MANY, batch_size, tokens_per_row])

    def announce_graphs(self, capture: bool) -> None:
        """Rank 0: every rank makes its decode graphs now (`capture=False`: their static
        buffers run eagerly, as on the CPU)."""
        self._send_header([GRAPHS, int(capture)])

    # -- data plane (device) ---------------------------------------------------------
    def broadcast_rows(self, rows: torch.Tensor) -> None:
        """A graph's input rows (device), from rank 0 into every rank's copy,
        queued on the stream."""
        dist.broadcast(rows, src=0)


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
    """The ForwardBatch that `batch_header` and `batch_payload` describe (on the payload's
    device)."""
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
