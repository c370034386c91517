"""The residual slot sum with the tensor-parallel exchange in it (issue 33,
kernels/quant_matmul/slot_sum.py's `launch_slot_sum_residual(..., exchange=...)`, the
ColumnExchange of kernels/tp_push_all_reduce.py): each program sums its chunk's slots (this
rank's float32 partial of a row-parallel o_proj or down_proj), pushes it into every peer's
cell, waits for the peers' partials of the same chunk, and adds them in rank order before
the residual add, the squares and h * w.

On the CPU (Triton interpreter), the ranks simulated in one process as in
tests/kernels/test_tp_push_all_reduce.py: the ranks run one after the other, what a later
rank would have pushed into an earlier rank's cell is stored there first, and a later
rank's late push into an earlier rank's cell is checked and freed afterwards.

What is tested: every rank's h, squares and xw are, bit for bit, what the slot sum without
an exchange gives for the rank-order sum of the partials (the push kernel's sum, so h is the
push path's), for 2 and 3 ranks, 1 and 2 rows, past RECV_SLOTS calls (every cell used, freed
and used again); each (row, chunk) keeps its own next slot; a rank pushes exactly its
partial into its peers' cells; rows or widths the exchange does not hold are refused."""

from __future__ import annotations

import os

import pytest
import torch

from helpers.triton_cpu import seeded_randn
from kernels.quant_matmul.slot_sum import SlotSumConfig, launch_slot_sum_residual
from kernels.tp_push_all_reduce import (
    EXCHANGE_BLOCK,
    RECV_SLOTS,
    SENTINEL,
    ColumnExchange,
    recv_words,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter"
)

N = 2 * EXCHANGE_BLOCK  # two chunks a row
MAX_ROWS = 2
SLOTS = 3  # the GEMV's split-K slots
SPINS = 64  # bounds every poll: a push that never came fails a check, never hangs


def _exchanges(world: int) -> list[ColumnExchange]:
    recvs = [
        torch.full((recv_words(world, MAX_ROWS, N),), SENTINEL, dtype=torch.int32)
        for _ in range(world)
    ]
    bases = torch.tensor([r.data_ptr() for r in recvs], dtype=torch.int64)
    return [
        ColumnExchange(
            recv=recv.view(RECV_SLOTS, world, MAX_ROWS, N),
            recv_bases=bases,
            slots=torch.zeros(MAX_ROWS, N // EXCHANGE_BLOCK, dtype=torch.int32),
            rank=rank,
            world=world,
            max_rows=MAX_ROWS,
            row_floats=N,
        )
        for rank, recv in enumerate(recvs)
    ]


def _workspaces(world: int, rows: int, call: int) -> list[torch.Tensor]:
    """Each rank's GEMV workspace [SLOTS, rows, N]: partials of mixed magnitudes, so that
    the order of the additions shows in the bits."""
    spaces = []
    for r in range(world):
        w = seeded_randn((SLOTS, rows, N), torch.float32, "cpu", seed=100 * call + r)
        w[r % SLOTS] *= 1000.0
        spaces.append(w.contiguous())
    return spaces


def _partial(space: torch.Tensor) -> torch.Tensor:
    """The slot sum's float32 partial: slots added in slot order from zero."""
    total = torch.zeros(space.shape[1:])
    for s in range(space.shape[0]):
        total = total + space[s]
    return total


def _expected(partials: list[torch.Tensor], residual, weight):
    """The slot sum without an exchange on one slot holding the rank-order sum."""
    total = partials[0]
    for p in partials[1:]:
        total = total + p
    h = torch.empty_like(residual)
    xw = torch.empty(residual.shape, dtype=torch.float32)
    squares = launch_slot_sum_residual(
        total.unsqueeze(0).contiguous(), residual, h, 1, norm_weight=weight, xw=xw,
        config=SlotSumConfig(EXCHANGE_BLOCK, 2),  # the exchange's chunks
    )  # fmt: skip
    return h, squares.sums, xw


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("rows", [1, 2])
def test_every_rank_gets_the_rank_order_sum_through_its_residual_add(world: int, rows: int):
    exchanges = _exchanges(world)
    dtype = torch.float16
    residual = seeded_randn((rows, N), dtype, "cpu", seed=7, scale=4.0)
    weight = seeded_randn((N,), dtype, "cpu", seed=8, scale=0.2) + 1
    for call in range(RECV_SLOTS + 2):
        spaces = _workspaces(world, rows, call)
        partials = [_partial(s) for s in spaces]
        slot = call % RECV_SLOTS
        # What the later ranks (run after this one) would have pushed by its poll.
        for r, ex in enumerate(exchanges):
            for q in range(r + 1, world):
                ex.recv[slot, q, :rows] = partials[q].view(torch.int32)
        want_h, want_squares, want_xw = _expected(partials, residual, weight)
        for ex, space in zip(exchanges, spaces, strict=True):
            h = torch.empty_like(residual)
            xw = torch.empty(residual.shape, dtype=torch.float32)
            squares = launch_slot_sum_residual(
                space, residual, h, SLOTS, norm_weight=weight, xw=xw, exchange=ex,
                max_spins=SPINS,
            )  # fmt: skip
            assert torch.equal(h.view(torch.int16), want_h.view(torch.int16)), (ex.rank, call)
            assert torch.equal(squares.sums, want_squares) and squares.chunk == EXCHANGE_BLOCK
            assert torch.equal(xw, want_xw)
            # Each (row, chunk) moved to its next slot; rows not called kept theirs.
            assert ex.slots[:rows].flatten().tolist() == [(call + 1) % RECV_SLOTS] * (
                rows * (N // EXCHANGE_BLOCK)
            )
            assert int(ex.slots[rows:].abs().sum()) == 0
        # The later ranks' late pushes into the earlier ranks' cells: exactly their
        # partials; freed, nothing else is left anywhere.
        for r, ex in enumerate(exchanges):
            for q in range(r + 1, world):
                cell = ex.recv[slot, q, :rows]
                assert torch.equal(cell, partials[q].view(torch.int32)), (r, q, call)
                cell.fill_(SENTINEL)
            assert bool((ex.recv == SENTINEL).all())
    if world == 3:  # the order of the ranks' additions matters for these partials
        ordered = partials[0] + partials[1] + partials[2]
        assert not torch.equal(partials[2] + partials[1] + partials[0], ordered)


def test_what_the_exchange_does_not_hold_is_refused() -> None:
    (ex, _) = _exchanges(2)
    residual = torch.zeros(MAX_ROWS + 1, N, dtype=torch.float16)
    space = torch.zeros(SLOTS, MAX_ROWS + 1, N)
    with pytest.raises(ValueError, match="do not fit the column exchange"):
        launch_slot_sum_residual(space, residual, torch.empty_like(residual), SLOTS, exchange=ex)
    narrow = torch.zeros(1, N // 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="do not fit the column exchange"):
        launch_slot_sum_residual(
            torch.zeros(SLOTS, 1, N // 2), narrow, torch.empty_like(narrow), SLOTS, exchange=ex
        )
    assert not ex.fits(1, N + 4) and ex.fits(1, N) and not ex.fits(0, N)
