"""The split-K workspace (kernels/quant_matmul/split_k.py, tiles.py): each program stores its
partial in its own slot and the last program of a tile adds the slots in slot order, so the
sum does not depend on the order in which programs finish (issue 31: float32 atomics did,
and GPU decode changed between runs). On a GPU, repeated matmuls never read a half-finished
sum and give the same bits every call."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from kernels.quant_matmul.split_k import split_k_workspace
from kernels.quant_matmul.tiles import finish_gemv_tile, store_partial


@triton.jit
def _arrive_in_order_kernel(partials_ptr, order_ptr, sums_ptr, y_ptr, counter_ptr, n,
                            PARTS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # Program i is split order[i]: it stores partial order[i] in slot order[i] and arrives.
    # The interpreter runs programs in index order, so the order of arrival is `order`; the
    # last to arrive writes y.
    i = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    part = tl.load(order_ptr + i)
    store_partial(sums_ptr, part, n, cols, tl.load(partials_ptr + part * n + cols, mask=ok), ok)
    finish_gemv_tile(sums_ptr, y_ptr, counter_ptr, PARTS, n, cols, ok, 1, PARTS)


def _sum_in_order(
    partials: torch.Tensor, order: list[int], out_dtype: torch.dtype, workspace_fill: float = 0.0
) -> torch.Tensor:
    parts, n = partials.shape
    sums = torch.full((parts * n,), workspace_fill, dtype=torch.float32, device=partials.device)
    counter = torch.zeros(1, dtype=torch.int32, device=partials.device)
    y = torch.empty(n, dtype=out_dtype, device=partials.device)
    order_t = torch.tensor(order, dtype=torch.int32, device=partials.device)
    _arrive_in_order_kernel[(parts,)](
        partials, order_t, sums, y, counter, n, PARTS=parts, BLOCK=triton.next_power_of_2(n)
    )
    assert counter.item() == 0, "the last program sets the tile's counter back to 0"
    return y


def _partials(parts: int, n: int, device: str) -> torch.Tensor:
    # Magnitudes over several binades, as a split-K's partials of one column have.
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(parts, n, generator=gen) * torch.logspace(-3, 2, parts)[:, None]
    return base.to(device)


def _interpreter_only() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the order of arrival is only controlled in the interpreter")


def _orders(parts: int) -> list[list[int]]:
    orders = [list(range(parts)), list(reversed(range(parts)))]
    gen = torch.Generator().manual_seed(0)
    return orders + [torch.randperm(parts, generator=gen).tolist() for _ in range(6)]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("parts", [24, 5])  # 3 unrolled groups of 8; the tail loop alone
def test_slot_sums_ignore_the_order_of_arrival(out_dtype: torch.dtype, parts: int) -> None:
    _interpreter_only()
    partials = _partials(parts, 64, "cpu")
    results = [_sum_in_order(partials, order, out_dtype) for order in _orders(parts)]
    for result in results[1:]:
        assert torch.equal(result, results[0])
    # The sum is the float32 sum in slot order 0, 1, 2, ..., rounded once to y's dtype
    # (bfloat16 aside: Triton 3.6's interpreter truncates to it, see kernels.backend.cast_rtne).
    want = torch.zeros(64, dtype=torch.float32)
    for part in partials:
        want = want + part
    if out_dtype != torch.bfloat16:
        assert torch.equal(results[0], want.to(out_dtype))


def test_the_property_is_not_vacuous() -> None:
    # Float32 sums of these partials in the orders above do differ in bits (the order of
    # arrival of atomics is what made GPU decode differ between runs), so equal results
    # above come from the fixed order, not from lucky partials.
    partials = _partials(24, 64, "cpu")
    sums = []
    for order in _orders(24):
        total = torch.zeros(64, dtype=torch.float32)
        for part in order:
            total = total + partials[part]
        sums.append(total)
    assert any(not torch.equal(s, sums[0]) for s in sums[1:])


def test_stale_workspace_contents_do_not_matter() -> None:
    # Nothing zeroes the slots between calls: every slot read is written by the call.
    _interpreter_only()
    partials = _partials(11, 40, "cpu")
    clean = _sum_in_order(partials, list(range(11)), torch.float32)
    dirty = _sum_in_order(partials, [3, 1, 4, 0, 5, 9, 2, 6, 8, 7, 10], torch.float32, float("nan"))
    assert torch.equal(clean, dirty)


def test_workspace_refuses_more_than_int32_offsets() -> None:
    with pytest.raises(ValueError, match="int32"):
        split_k_workspace(torch.device("cpu"), 1 << 31, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_repeated_matmuls_are_right_and_bit_identical(rows: int) -> None:
    """Every call must be right (before a barrier in the finishing program, 1 call in 200 of
    a 64-row matmul on an H100 read a half-finished sum) and give the same bits."""
    from helpers.quant_weights import make_weight
    from kernels.quant_matmul import dequantize_reference, quant_matmul_triton

    qw = make_weight(4096, 4096, [4], group_size=128, device="cuda", seed=1, bias=False)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.float16)
    want = (x.double() @ dequantize_reference(qw).double()).float()
    outs = torch.stack([quant_matmul_triton(x, qw) for _ in range(200)]).float()
    errors = (outs - want).abs().amax(dim=(1, 2))
    assert errors.max() < 0.25, f"calls {errors.gt(0.25).nonzero().flatten().tolist()} are wrong"
    assert (outs == outs[0]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_other_output_dtypes_are_bit_identical_too(dtype: torch.dtype) -> None:
    from helpers.quant_weights import make_weight
    from kernels.quant_matmul import quant_matmul_triton

    qw = make_weight(4096, 4096, [4], group_size=128, device="cuda", seed=2, bias=False)
    x = torch.randn(1, 4096, device="cuda", dtype=dtype)
    outs = torch.stack([quant_matmul_triton(x, qw) for _ in range(100)])
    assert (outs == outs[0]).all()
