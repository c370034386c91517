"""The split-K workspace (kernels/quant_matmul/split_k.py): with deterministic sums, float16
outputs sum as fixed point and do not depend on the order in which partials arrive; float32
sums (the default) may. On a GPU, repeated matmuls never read a half-finished sum (issue 31:
the last program of a tile zeroed sums that a replica thread had not read yet)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import triton
import triton.language as tl

import kernels.backend as backend
from kernels.quant_matmul.split_k import (
    check_fixed_point_arrivals,
    sums_view,
)
from kernels.quant_matmul.tiles import (
    FIXED_POINT_LIMIT,
    FIXED_POINT_SCALE,
    MAX_FIXED_POINT_ARRIVALS,
    add_partial,
    take_sums,
)


@pytest.fixture
def deterministic() -> Iterator[None]:
    before = backend.deterministic_sums()
    backend.set_deterministic_sums(True)
    yield
    backend.set_deterministic_sums(before)


@triton.jit
def _add_in_order_kernel(partials_ptr, order_ptr, sums_ptr, out_ptr, n, PARTS: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    # Program i adds partial order[i]; the interpreter runs programs in index order, so the
    # order of arrival is `order`. The last program reads the sums back.
    i = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    part = tl.load(order_ptr + i)
    add_partial(sums_ptr, cols, tl.load(partials_ptr + part * n + cols, mask=ok), ok)
    if i == PARTS - 1:
        tl.store(out_ptr + cols, take_sums(sums_ptr, cols, ok), mask=ok)


def _sum_in_order(partials: torch.Tensor, order: list[int], out_dtype: torch.dtype):
    parts, n = partials.shape
    workspace = torch.zeros(n, dtype=torch.int64, device=partials.device)
    sums = sums_view(workspace, out_dtype)
    out = torch.empty(n, dtype=torch.float32, device=partials.device)
    order_t = torch.tensor(order, dtype=torch.int32, device=partials.device)
    _add_in_order_kernel[(parts,)](
        partials, order_t, sums, out, n, PARTS=parts, BLOCK=triton.next_power_of_2(n)
    )
    assert not workspace.any(), "take_sums leaves the workspace zeroed"
    return out


def _partials(parts: int, n: int, device: str) -> torch.Tensor:
    # Magnitudes over several binades, as a split-K's partials of one column have.
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(parts, n, generator=gen) * torch.logspace(-3, 2, parts)[:, None]
    return base.to(device)


@pytest.mark.parametrize("device", ["cpu"])
def test_fixed_point_sums_ignore_the_order_of_arrival(device: str, deterministic: None) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the order of arrival is only controlled in the interpreter")
    partials = _partials(24, 64, device)
    orders = [list(range(24)), list(reversed(range(24)))]
    orders += [torch.randperm(24, generator=torch.Generator().manual_seed(s)).tolist()
               for s in range(6)]  # fmt: skip
    fixed = [_sum_in_order(partials, o, torch.float16) for o in orders]
    backend.set_deterministic_sums(False)  # float16 outputs, float32 atomics
    floats = [_sum_in_order(partials, o, torch.float16) for o in orders]
    for result in fixed[1:]:
        assert torch.equal(result, fixed[0])
    # The property is not vacuous: float32 sums of the same partials do change bits with
    # the order (this is what made GPU decode differ between runs).
    assert any(not torch.equal(result, floats[0]) for result in floats[1:])
    # And the fixed-point sum is as accurate as float32 sums are.
    exact = partials.double().sum(0)
    assert (fixed[0].double() - exact).abs().max() <= 1e-6 * exact.abs().max()


def test_fixed_point_clamps_non_finite_partials_to_overflow(deterministic: None) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernel on CPU tensors")
    partials = torch.tensor([[1.0, -2.0, float("nan")], [float("inf"), 3.0, 0.5]])
    out = _sum_in_order(partials, [0, 1], torch.float16)
    assert out[1] == 1.0
    # Beyond float16's range: the cast to float16 gives inf, as float sums would.
    assert out[0].half().isinf() and out[2].half().isinf()
    assert FIXED_POINT_LIMIT > 16 * 65504 and FIXED_POINT_SCALE == 2.0**32
    # 1024 clamped partials fit the 64 bits.
    assert MAX_FIXED_POINT_ARRIVALS * FIXED_POINT_LIMIT * FIXED_POINT_SCALE < 2.0**63


def test_too_many_partials_are_refused_by_name() -> None:
    check_fixed_point_arrivals(MAX_FIXED_POINT_ARRIVALS)
    with pytest.raises(ValueError, match="split-K partials"):
        check_fixed_point_arrivals(MAX_FIXED_POINT_ARRIVALS + 1)


def test_the_workspace_view_follows_the_switch(deterministic: None) -> None:
    workspace = torch.zeros(8, dtype=torch.int64)
    assert sums_view(workspace, torch.float16).dtype == torch.int64
    # bfloat16 and float32 need float sums: more range than 64-bit fixed point has.
    assert sums_view(workspace, torch.bfloat16).dtype == torch.float32
    backend.set_deterministic_sums(False)
    assert sums_view(workspace, torch.float16).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_repeated_matmuls_never_read_a_half_finished_sum(fixed: bool, rows: int) -> None:
    """Before the barrier in take_sums, 1 call in 200 of a 64-row matmul on an H100 came
    back with errors as large as the values (a replica thread read a sum another thread of
    the finishing program had already zeroed). Every call must be right; with fixed-point
    sums every call must also be bit-identical."""
    from test_quant_matmul_kernels import make_weight

    from kernels.quant_matmul import dequantize_reference, quant_matmul_triton

    before = backend.deterministic_sums()
    backend.set_deterministic_sums(fixed)
    try:
        qw = make_weight(4096, 4096, [4], group_size=128, device="cuda", seed=1, bias=False)
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.float16)
        want = (x.double() @ dequantize_reference(qw).double()).float()
        outs = torch.stack([quant_matmul_triton(x, qw) for _ in range(200)]).float()
    finally:
        backend.set_deterministic_sums(before)
    errors = (outs - want).abs().amax(dim=(1, 2))
    assert errors.max() < 0.25, f"calls {errors.gt(0.25).nonzero().flatten().tolist()} are wrong"
    if fixed:
        assert (outs == outs[0]).all()
