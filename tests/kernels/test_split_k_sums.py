"""The split-K workspace (kernels/quant_matmul/split_k.py, tiles.py, slot_sum.py): each
program stores its partial in its own slot, and the slots are added in slot order (by the
decode GEMV's slot-sum kernel, or by the last program of a mid-M tile), so the sum does not
depend on the order in which programs finish (issue 31: float32 atomics did, and GPU decode
changed between runs). On a GPU, repeated matmuls never read a half-finished sum and give
the same bits every call."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from kernels.quant_matmul.dot import finish_dot_tile
from kernels.quant_matmul.slot_sum import SlotSumConfig, launch_slot_sum, slot_sum_config
from kernels.quant_matmul.split_k import split_k_workspace
from kernels.quant_matmul.tiles import store_partial


def _interpreter_only() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the order of programs is only controlled in the interpreter")


@triton.jit
def _store_in_order_kernel(partials_ptr, order_ptr, sums_ptr, elements,
                           BLOCK: tl.constexpr):  # fmt: skip
    # Program i stores partial order[i] in slot order[i]. The interpreter runs programs in
    # index order, so the slots are written in the order `order`.
    i = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    ok = offsets < elements
    part = tl.load(order_ptr + i)
    values = tl.load(partials_ptr + part * elements + offsets, mask=ok)
    store_partial(sums_ptr, part, elements, offsets, values, ok)


@triton.jit
def _dot_arrive_in_order_kernel(partials_ptr, order_ptr, sums_ptr, y_ptr, counter_ptr,
                                elements, PARTS: tl.constexpr,
                                BLOCK: tl.constexpr):  # fmt: skip
    # The mid-M path's finish: program i stores partial order[i] in its slot and arrives at
    # the tile's counter; the last to arrive sums the slots and writes y.
    i = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    ok = offsets < elements
    part = tl.load(order_ptr + i)
    values = tl.load(partials_ptr + part * elements + offsets, mask=ok)
    store_partial(sums_ptr, part, elements, offsets, values, ok)
    finish_dot_tile(sums_ptr, y_ptr, offsets, ok, counter_ptr, PARTS, elements, PARTS)


def _order_tensor(order: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(order, dtype=torch.int32, device=device)


def _slot_sum_in_order(
    partials: torch.Tensor,
    order: list[int],
    y: torch.Tensor,
    workspace_fill: float = 0.0,
    config: SlotSumConfig | None = None,
) -> torch.Tensor:
    """partials [parts, elements] stored in slots in `order`, then the slot-sum kernel."""
    parts, elements = partials.shape
    sums = torch.full(
        ((parts + 1) * elements,), workspace_fill, dtype=torch.float32, device=partials.device
    )  # one slot more than read: its NaN must stay out of y
    _store_in_order_kernel[(parts,)](
        partials, _order_tensor(order, partials.device), sums, elements,
        BLOCK=triton.next_power_of_2(elements),
    )  # fmt: skip
    launch_slot_sum(sums, y, parts, config=config)
    return y


def _dot_sum_in_order(
    partials: torch.Tensor, order: list[int], out_dtype: torch.dtype, workspace_fill: float = 0.0
) -> torch.Tensor:
    parts, elements = partials.shape
    sums = torch.full((parts * elements,), workspace_fill, dtype=torch.float32)
    counter = torch.zeros(1, dtype=torch.int32)
    y = torch.empty(elements, dtype=out_dtype)
    _dot_arrive_in_order_kernel[(parts,)](
        partials, _order_tensor(order, partials.device), sums, y, counter, elements,
        PARTS=parts, BLOCK=triton.next_power_of_2(elements),
    )  # fmt: skip
    assert counter.item() == 0, "the last program sets the tile's counter back to 0"
    return y


def _partials(parts: int, elements: int, device: str = "cpu") -> torch.Tensor:
    # Magnitudes over several binades, as a split-K's partials of one column have.
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(parts, elements, generator=gen) * torch.logspace(-3, 2, parts)[:, None]
    return base.to(device)


def _in_slot_order(partials: torch.Tensor) -> torch.Tensor:
    """The float32 sum ((0 + p0) + p1) + ... of the rows of partials."""
    want = torch.zeros(partials.shape[1], dtype=torch.float32, device=partials.device)
    for part in partials:
        want = want + part
    return want


def _orders(parts: int) -> list[list[int]]:
    orders = [list(range(parts)), list(reversed(range(parts)))]
    gen = torch.Generator().manual_seed(0)
    return orders + [torch.randperm(parts, generator=gen).tolist() for _ in range(6)]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("parts", [113, 24, 5, 1])  # 8B's down_proj has 112 splits (+ LoRA)
def test_slot_sum_is_the_float32_sum_in_slot_order(out_dtype: torch.dtype, parts: int) -> None:
    # y = the float32 sum of the slots in slot order 0, 1, 2, ..., rounded once to y's
    # dtype, in whatever order the slots were written. 200 elements: y [2, 100] of the
    # GEMV's layout, more than one program of 32 and a partial last one.
    _interpreter_only()
    partials = _partials(parts, 200)
    want = _in_slot_order(partials).to(out_dtype)
    config = SlotSumConfig(block=32, num_warps=1)
    for order in _orders(parts)[:3]:
        y = torch.empty(2, 100, dtype=out_dtype)
        _slot_sum_in_order(partials, order, y, float("nan"), config)
        assert torch.equal(y.flatten(), want)


def test_slot_sum_under_the_default_config() -> None:
    _interpreter_only()
    partials = _partials(7, 1000)
    y = torch.empty(1000, dtype=torch.float16)
    _slot_sum_in_order(partials, list(range(7)), y, float("nan"))
    assert torch.equal(y, _in_slot_order(partials).half())


def test_slot_sum_checks_its_arguments() -> None:
    sums = torch.zeros(10, dtype=torch.float32)
    with pytest.raises(ValueError, match="at least 3 x 4 elements"):
        launch_slot_sum(sums, torch.empty(4), 3)
    with pytest.raises(ValueError, match="contiguous"):
        launch_slot_sum(torch.zeros(100), torch.empty(4, 4).t(), 2)


@pytest.mark.parametrize("slots", [1, 5, 33, 113])
@pytest.mark.parametrize("elements", [64, 4096, 28672, 2 * 128256])
def test_slot_sum_config_keeps_every_load_in_flight(elements: int, slots: int) -> None:
    # Powers of two from 32 to 1024 elements per program, at most 4 warps, at least one
    # element per thread, and at most 64 loads in flight per thread, or one per slot.
    config = slot_sum_config(elements, slots, torch.device("cpu"))
    assert config.block in [1 << i for i in range(5, 11)]
    assert config.num_warps in (1, 2, 4)
    per_thread = config.block // (32 * config.num_warps)
    assert per_thread >= 1
    assert per_thread * slots <= max(64, slots)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("parts", [24, 5])  # 3 unrolled groups of 8; the tail loop alone
def test_dot_tile_sums_ignore_the_order_of_arrival(out_dtype: torch.dtype, parts: int) -> None:
    # The mid-M path sums in its tile's last program: the same y whatever the order of
    # arrival, the float32 sum in slot order rounded once.
    _interpreter_only()
    partials = _partials(parts, 64)
    results = [_dot_sum_in_order(partials, order, out_dtype) for order in _orders(parts)]
    for result in results[1:]:
        assert torch.equal(result, results[0])
    assert torch.equal(results[0], _in_slot_order(partials).to(out_dtype))


def test_the_property_is_not_vacuous() -> None:
    # Float32 sums of these partials in the orders above do differ in bits (the order of
    # arrival of atomics is what made GPU decode differ between runs), so equal results
    # above come from the fixed order, not from lucky partials.
    partials = _partials(24, 64)
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
    partials = _partials(11, 40)
    order = [3, 1, 4, 0, 5, 9, 2, 6, 8, 7, 10]
    clean = _dot_sum_in_order(partials, list(range(11)), torch.float32)
    assert torch.equal(clean, _dot_sum_in_order(partials, order, torch.float32, float("nan")))
    y = torch.empty(40)
    assert torch.equal(clean, _slot_sum_in_order(partials, order, y, float("nan")))


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_gemv_output_is_its_slots_summed_in_order(M: int, out_dtype: torch.dtype) -> None:
    # The decode GEMV end to end: y is exactly the slot-order float32 sum of the partials
    # that its programs left in the workspace (three segments: slots across their launches).
    _interpreter_only()
    from helpers.quant_weights import make_weight
    from kernels.quant_matmul.gemv import gemv_slots, gemv_tiling, launch_gemv

    qw = make_weight(320, 200, [4, 3, 8], device="cpu", seed=7)
    x = torch.randn(M, 320, generator=torch.Generator().manual_seed(M)).to(out_dtype)
    tiling = gemv_tiling(x, qw)
    slots = gemv_slots(tiling)
    assert slots >= 3  # at least one split per segment
    sums, _ = split_k_workspace(x.device, slots * M * 200, 0)
    sums.fill_(float("nan"))
    y = torch.empty(M, 200, dtype=out_dtype)
    launch_gemv(x, qw, y, tiling)
    partials = sums[: slots * M * 200].view(slots, M * 200)
    assert not partials.isnan().any()  # every slot of every element written
    assert torch.equal(y.flatten(), _in_slot_order(partials).to(out_dtype))


def test_workspace_refuses_more_than_int32_offsets() -> None:
    with pytest.raises(ValueError, match="int32"):
        split_k_workspace(torch.device("cpu"), 1 << 31, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 8, 64])
def test_repeated_matmuls_are_right_and_bit_identical(rows: int) -> None:
    """Every call must be right (before a barrier in the finishing program, 1 call in 200 of
    a 64-row matmul on an H100 read a half-finished sum; the slot sum must wait for the
    whole GEMV) and give the same bits."""
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
def test_slot_sum_after_the_gemv_in_a_graph_is_right() -> None:
    # With programmatic dependent launch the slot sum is resident before the GEMV ends: in
    # a graph of back-to-back GEMVs (each one's slot sum, then the next GEMV overwriting
    # the same slots), every output must equal an eager call's bits.
    from helpers.quant_weights import make_weight
    from kernels.quant_matmul import quant_matmul_triton

    weights = [
        make_weight(4096, n, [4], group_size=128, device="cuda", seed=s, bias=False)
        for s, n in enumerate((4096, 6144, 1024))
    ]
    x = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    outs = [torch.empty(1, qw.out_features, device="cuda", dtype=torch.float16) for qw in weights]
    eager = [quant_matmul_triton(x, qw) for qw in weights]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            for qw, out in zip(weights, outs, strict=True):
                quant_matmul_triton(x, qw, out=out)
    for _ in range(20):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for out, want in zip(outs, eager, strict=True):
            assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_other_output_dtypes_are_bit_identical_too(dtype: torch.dtype) -> None:
    from helpers.quant_weights import make_weight
    from kernels.quant_matmul import quant_matmul_triton

    qw = make_weight(4096, 4096, [4], group_size=128, device="cuda", seed=2, bias=False)
    x = torch.randn(1, 4096, device="cuda", dtype=dtype)
    outs = torch.stack([quant_matmul_triton(x, qw) for _ in range(100)])
    assert (outs == outs[0]).all()
