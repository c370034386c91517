"""kernels/tp_push_from_slots.py on the CPU (Triton interpreter), the ranks simulated in one
process as in tests/kernels/test_tp_push_all_reduce.py: each rank's receive region is a CPU
tensor that the other ranks' kernels store into through its raw address, and the ranks run
one after the other, so what a later rank would have pushed into an earlier rank's cells is
stored there first, and `_settle` checks and frees the later ranks' real pushes.

Each rank's GEMV output is K split-K slots of partials; the kernel must give the bits of the
slot sum (slots added in order) followed by the push kernel: the rank-order sum cast to the
activation dtype, or kernels.add_rms_norm of it. Rows are wider than one chunk and not a
whole number of chunks, so several programs share a row and the last is partial."""

from __future__ import annotations

import os

import pytest
import torch

from helpers.rank_partials import rank_order_sum
from kernels.rms_norm import add_rms_norm
from kernels.tp_push_all_reduce import RECV_SLOTS, SENTINEL, PushBuffers, recv_words
from kernels.tp_push_from_slots import (
    CHUNK,
    ChunkState,
    chunk_state,
    push_from_slots,
    push_from_slots_add_rms_norm,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter"
)

MAX_ROWS, ROW_FLOATS = 2, 4 * CHUNK
HIDDEN = 3 * CHUNK + 76  # four chunk programs per row, the last one partial
K_SLOTS = 5
SPINS = 64  # a push that never came fails a check, never hangs


def _ranks(world: int) -> tuple[list[PushBuffers], list[ChunkState]]:
    recvs = [
        torch.full((recv_words(world, MAX_ROWS, ROW_FLOATS),), SENTINEL, dtype=torch.int32)
        for _ in range(world)
    ]
    bases = torch.tensor([r.data_ptr() for r in recvs], dtype=torch.int64)
    pushes = [
        PushBuffers(
            recv=recv.view(RECV_SLOTS, world, MAX_ROWS, ROW_FLOATS),
            recv_bases=bases,
            slots=torch.zeros(MAX_ROWS, dtype=torch.int32),  # the row kernel's, unused here
            rank=rank,
            world=world,
            max_rows=MAX_ROWS,
            row_floats=ROW_FLOATS,
        )
        for rank, recv in enumerate(recvs)
    ]
    return pushes, [chunk_state(p, torch.device("cpu")) for p in pushes]


def _gemv_slots(world: int, rows: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per rank: its workspace (K_SLOTS slots of [rows, HIDDEN], then unrelated values) and
    the slot sum in slot order, its partial."""
    g = torch.Generator().manual_seed(seed)
    workspaces, parts = [], []
    for r in range(world):
        slots = torch.randn(K_SLOTS, rows, HIDDEN, generator=g) * (3.0**r)
        total = torch.zeros(rows, HIDDEN)
        for s in slots:
            total = total + s
        tail = torch.randn(rows * HIDDEN, generator=g)  # past the slots: must not be read
        workspaces.append(torch.cat([slots.reshape(-1), tail]))
        parts.append(total)
    return workspaces, parts


def _stage(pushes: list[PushBuffers], parts: list[torch.Tensor], slot: int) -> None:
    rows = parts[0].shape[0]
    for r, p in enumerate(pushes):
        for q in range(r + 1, len(pushes)):
            p.recv[slot, q, :rows, :HIDDEN] = parts[q].view(torch.int32)


def _settle(pushes: list[PushBuffers], parts: list[torch.Tensor], slot: int) -> None:
    rows = parts[0].shape[0]
    for r, p in enumerate(pushes):
        for q in range(r + 1, len(pushes)):
            cell = p.recv[slot, q, :rows, :HIDDEN]
            assert torch.equal(cell, parts[q].view(torch.int32))
            cell.fill_(SENTINEL)
        assert bool((p.recv == SENTINEL).all())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_sum_has_the_slot_sums_and_the_push_kernels_bits(
    world: int, dtype: torch.dtype
) -> None:
    pushes, states = _ranks(world)
    rows = 2
    chunks = -(-HIDDEN // CHUNK)
    for call in range(RECV_SLOTS + 1):
        slot = call % RECV_SLOTS
        workspaces, parts = _gemv_slots(world, rows, call)
        _stage(pushes, parts, slot)
        outs = [
            push_from_slots(w, K_SLOTS, p, s, rows, HIDDEN, dtype, max_spins=SPINS)
            for w, p, s in zip(workspaces, pushes, states, strict=True)
        ]
        expected = rank_order_sum(parts).to(dtype)
        for out in outs:
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
        for s in states:
            assert s.slots[:rows, :chunks].unique().tolist() == [(call + 1) % RECV_SLOTS]
            assert int(s.slots[:, chunks:].abs().sum()) == 0  # no program past the row
        _settle(pushes, parts, slot)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_the_fused_norm_has_add_rms_norms_bits(dtype: torch.dtype, unit_offset: bool) -> None:
    """The row's last chunk program finishes the norm from every chunk's sum of squares
    and stored h: kernels.add_rms_norm's bits on the rounded sum, and the count is back
    at zero for the next call."""
    pushes, states = _ranks(2)
    rows, eps = 2, 1e-5
    g = torch.Generator().manual_seed(5)
    weight = (torch.rand(HIDDEN, generator=g) + 0.5).to(dtype)
    for call in range(2):
        slot = call % RECV_SLOTS
        workspaces, parts = _gemv_slots(2, rows, 40 + call)
        residual = (torch.randn(rows, HIDDEN, generator=g) * 4).to(dtype)
        _stage(pushes, parts, slot)
        results = [
            push_from_slots_add_rms_norm(
                w, K_SLOTS, p, s, residual, weight, eps, unit_offset=unit_offset, max_spins=SPINS
            )
            for w, p, s in zip(workspaces, pushes, states, strict=True)
        ]
        summed = rank_order_sum(parts).to(dtype)
        normed_ref, residual_ref = add_rms_norm(
            summed, residual, weight, eps, unit_offset=unit_offset, backend="triton"
        )
        for normed, new_residual in results:
            assert torch.equal(new_residual.view(torch.int16), residual_ref.view(torch.int16))
            assert torch.equal(normed.view(torch.int16), normed_ref.view(torch.int16))
        for s in states:
            assert int(s.arrivals.abs().sum()) == 0
        _settle(pushes, parts, slot)


def test_a_workspace_without_the_slots_is_refused() -> None:
    pushes, states = _ranks(2)
    short = torch.zeros(K_SLOTS * HIDDEN - 1)
    with pytest.raises(ValueError, match="fewer than 5 slots of 1x"):
        push_from_slots(short, K_SLOTS, pushes[0], states[0], 1, HIDDEN, torch.float16)
    with pytest.raises(ValueError, match="does not fit"):
        push_from_slots(
            torch.zeros(K_SLOTS * 3 * HIDDEN), K_SLOTS, pushes[0], states[0], 3, HIDDEN,
            torch.float16,
        )  # fmt: skip
