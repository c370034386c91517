"""kernels/tp_push_all_reduce.py on the CPU (Triton interpreter), the ranks simulated in
one process: each rank's receive region is a CPU tensor, and a kernel stores into the
other ranks' regions through their raw addresses as it would into a peer GPU's over NVLink.

A rank's kernel polls for its peers' pushes, so the tests run the ranks one after the
other: what a later rank (not run yet) would have pushed into an earlier rank's cell, the
test stores there first; later ranks find what the earlier ranks' kernels pushed. A later
rank's own push then lands in the earlier rank's cell after that rank has read and freed
it (on GPUs it is that push the earlier rank reads): `_settle` checks it is the staged
partial and frees the cell as the earlier rank had.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers.rank_partials import order_sensitive_partials, rank_order_sum
from kernels.rms_norm import add_rms_norm
from kernels.tp_all_reduce import SiteBuffers
from kernels.tp_push_all_reduce import (
    CANONICAL_NAN,
    RECV_SLOTS,
    SENTINEL,
    PushBuffers,
    push_all_reduce,
    push_all_reduce_add_rms_norm,
    recv_words,
)

# CPU buffers stand for the ranks' GPU memory: only the interpreter runs kernels on them
# (the kernel on 2 GPUs: tools/check_tp_all_reduce.py --kernel push).
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter"
)

SITES, SITE_FLOATS, MAX_ROWS, ROW_FLOATS = 3, 4 * 96, 4, 96
# Bounds every poll of these tests: a push that never came fails a check, never hangs.
SPINS = 64


def _ranks(world: int) -> tuple[list[SiteBuffers], list[PushBuffers]]:
    """Every rank's site slices (local) and receive region (every word SENTINEL)."""
    recvs = [
        torch.full((recv_words(world, MAX_ROWS, ROW_FLOATS),), SENTINEL, dtype=torch.int32)
        for _ in range(world)
    ]
    recv_bases = torch.tensor([r.data_ptr() for r in recvs], dtype=torch.int64)
    sites, pushes = [], []
    for rank, recv in enumerate(recvs):
        data = torch.zeros(SITES * SITE_FLOATS)
        bases = torch.tensor([data.data_ptr()] * world, dtype=torch.int64)  # unused here
        sites.append(
            SiteBuffers(
                data=data,
                data_bases=bases,
                flag_bases=bases,
                epochs=torch.zeros(SITES, MAX_ROWS, dtype=torch.int32),
                rank=rank,
                world=world,
                sites=SITES,
                site_elements=SITE_FLOATS,
                max_rows=MAX_ROWS,
            )
        )
        pushes.append(
            PushBuffers(
                recv=recv.view(RECV_SLOTS, world, MAX_ROWS, ROW_FLOATS),
                recv_bases=recv_bases,
                slots=torch.zeros(MAX_ROWS, dtype=torch.int32),
                rank=rank,
                world=world,
                max_rows=MAX_ROWS,
                row_floats=ROW_FLOATS,
            )
        )
    return sites, pushes


def _stage(
    sites: list[SiteBuffers],
    pushes: list[PushBuffers],
    site: int,
    parts: list[torch.Tensor],
    call: int,
) -> None:
    """Every rank's partial into its site slice (the GEMV's part), and what each rank's
    later peers would have pushed by the time it polls (the ranks run in rank order)."""
    rows, hidden = parts[0].shape
    slot = call % RECV_SLOTS
    for r, s in enumerate(sites):
        s.site_slice(site, rows, hidden).copy_(parts[r])
        for q in range(r + 1, len(sites)):
            pushes[r].recv[slot, q, :rows, :hidden] = parts[q].view(torch.int32)


def _settle(pushes: list[PushBuffers], parts: list[torch.Tensor], call: int) -> None:
    """After every rank ran `call`: the only words not SENTINEL are the later ranks' late
    pushes into the earlier ranks' cells of this call, each the staged partial; freed here."""
    rows, hidden = parts[0].shape
    slot = call % RECV_SLOTS
    for r, p in enumerate(pushes):
        for q in range(r + 1, len(pushes)):
            cell = p.recv[slot, q, :rows, :hidden]
            assert torch.equal(cell, parts[q].view(torch.int32))
            cell.fill_(SENTINEL)
        assert bool((p.recv == SENTINEL).all())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sum_in_rank_order_same_bits_on_every_rank(world: int, dtype: torch.dtype) -> None:
    sites, pushes = _ranks(world)
    rows, hidden, site = 3, 96, 1
    # Past RECV_SLOTS calls: every slot is used, reset and used again.
    for call in range(RECV_SLOTS + 2):
        parts = order_sensitive_partials(world, rows, hidden, call, dtype)
        _stage(sites, pushes, site, parts, call)
        outs = [
            push_all_reduce(s, p, site, rows, hidden, dtype, max_spins=SPINS)
            for s, p in zip(sites, pushes, strict=True)
        ]
        expected = rank_order_sum(parts).to(dtype)
        for out in outs:
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
        for p in pushes:
            assert p.slots[:rows].tolist() == [(call + 1) % RECV_SLOTS] * rows
            assert int(p.slots[rows:].abs().sum()) == 0  # rows not called
        # Every cell was read and freed: nothing else left anywhere.
        _settle(pushes, parts, call)
    if world == 3:
        # The order matters for these partials: the rank-order sum is a real constraint.
        swapped = (parts[2] + parts[1] + parts[0]).to(dtype)
        assert float(expected[0, 0]) == 1.0 and float(swapped[0, 0]) > 1.0
        assert not torch.equal(swapped, expected)


def test_a_rank_pushes_its_partial_into_the_peers_cell_of_this_call() -> None:
    """Rank 0 alone (rank 1 not run yet): its partial lands in rank 1's cell of rank 0 for
    this call's slot, bit for bit, and nowhere else; rank 1's own cells stay free."""
    sites, pushes = _ranks(2)
    rows, hidden, site = 2, 80, 0
    for call in range(2):
        parts = order_sensitive_partials(2, rows, hidden, 10 + call, torch.float16)
        _stage(sites, pushes, site, parts, call)
        push_all_reduce(sites[0], pushes[0], site, rows, hidden, torch.float16, max_spins=SPINS)
        slot = call % RECV_SLOTS
        landed = pushes[1].recv[slot, 0, :rows, :hidden]
        assert torch.equal(landed, parts[0].view(torch.int32))
        written = pushes[1].recv != SENTINEL
        assert int(written.sum()) == rows * hidden
        # Rank 1 reads it: both ranks end with free cells and the same sum.
        out = push_all_reduce(
            sites[1], pushes[1], site, rows, hidden, torch.float16, max_spins=SPINS
        )
        assert torch.equal(out, rank_order_sum(parts).half())
        _settle(pushes, parts, call)


def test_a_partial_word_with_the_sentinels_bits_is_sent_as_another_nan() -> None:
    """A NaN partial whose bits are SENTINEL would leave the peer polling for ever: it is
    sent as CANONICAL_NAN, and both ranks' sums are NaN there."""
    sites, pushes = _ranks(2)
    rows, hidden, site = 1, 96, 2
    parts = order_sensitive_partials(2, rows, hidden, 3, torch.float16)
    parts[0].view(torch.int32)[0, 5] = SENTINEL
    _stage(sites, pushes, site, parts, 0)
    out0 = push_all_reduce(sites[0], pushes[0], site, rows, hidden, torch.float16, max_spins=SPINS)
    assert int(pushes[1].recv[0, 0, 0, 5]) == CANONICAL_NAN
    out1 = push_all_reduce(sites[1], pushes[1], site, rows, hidden, torch.float16, max_spins=SPINS)
    for out in (out0, out1):
        assert bool(torch.isnan(out[0, 5]))
        assert int(torch.isnan(out).sum()) == 1
    assert torch.equal(out0.view(torch.int16), out1.view(torch.int16))
    _settle(pushes, parts, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_fused_add_rms_norm_matches_the_separate_ops(dtype: torch.dtype, unit_offset: bool) -> None:
    sites, pushes = _ranks(2)
    rows, hidden, site, eps = 4, 80, 2, 1e-5
    g = torch.Generator().manual_seed(7)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    for call in range(2):
        parts = [torch.randn(rows, hidden, generator=g) * 3 for _ in sites]
        residual = (torch.randn(rows, hidden, generator=g) * 4).to(dtype)
        _stage(sites, pushes, site, parts, call)
        results = [
            push_all_reduce_add_rms_norm(
                s, p, site, residual, weight, eps, unit_offset=unit_offset, max_spins=SPINS
            )
            for s, p in zip(sites, pushes, strict=True)
        ]
        summed = (parts[0] + parts[1]).to(dtype)
        normed_ref, residual_ref = add_rms_norm(
            summed, residual, weight, eps, unit_offset=unit_offset, backend="triton"
        )
        for normed, new_residual in results:
            assert torch.equal(new_residual.view(torch.int16), residual_ref.view(torch.int16))
            assert torch.equal(normed.view(torch.int16), normed_ref.view(torch.int16))
        _settle(pushes, parts, call)


def test_rows_that_do_not_fit_are_refused() -> None:
    sites, pushes = _ranks(2)
    with pytest.raises(ValueError, match="does not fit"):
        push_all_reduce(sites[0], pushes[0], 0, MAX_ROWS + 1, 96, torch.float16)
    with pytest.raises(ValueError, match="does not fit"):
        push_all_reduce(sites[0], pushes[0], 0, 1, ROW_FLOATS + 32, torch.float16)
    with pytest.raises(ValueError, match="does not fit"):
        push_all_reduce(sites[0], pushes[0], SITES, 1, 96, torch.float16)


def test_the_slots_cycle_without_a_growing_count() -> None:
    """The kernel keeps each row's next slot, not a call count that would wrap past 2**31
    (days of serving) into negative slots: after any number of calls it stays in
    [0, RECV_SLOTS), and a row resumes from whatever slot it holds."""
    sites, pushes = _ranks(2)
    rows, hidden, site = 1, 96, 0
    for p in pushes:
        p.slots[0] = RECV_SLOTS - 1  # as left by some earlier call
    for call in range(RECV_SLOTS + 1):
        slot = (RECV_SLOTS - 1 + call) % RECV_SLOTS
        parts = order_sensitive_partials(2, rows, hidden, 20 + call, torch.float16)
        for r, s in enumerate(sites):
            s.site_slice(site, rows, hidden).copy_(parts[r])
        pushes[0].recv[slot, 1, :rows, :hidden] = parts[1].view(torch.int32)
        outs = [
            push_all_reduce(s, p, site, rows, hidden, torch.float16, max_spins=SPINS)
            for s, p in zip(sites, pushes, strict=True)
        ]
        for out in outs:
            assert torch.equal(out, rank_order_sum(parts).half())
        for p in pushes:
            assert int(p.slots[0]) == (slot + 1) % RECV_SLOTS
        # Rank 1's late push landed in this call's slot (see _settle).
        assert torch.equal(pushes[0].recv[slot, 1, :rows, :hidden], parts[1].view(torch.int32))
        pushes[0].recv[slot, 1].fill_(SENTINEL)
        assert bool((pushes[0].recv == SENTINEL).all()) and bool((pushes[1].recv == SENTINEL).all())
