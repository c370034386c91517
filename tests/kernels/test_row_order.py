"""The fold's inputs stored in the next weight's row order (issue 28, kernels/quant_matmul/
slot_sum.py's scatter, split_k.row_order): a slot sum that stores column c of its output at
column row_order[c] hands the next GEMV x[:, perm], which that GEMV reads without a gather.

What is tested, through the interpreter on CPU (and compiled on a GPU): row_order is perm's
inverse (cached, None without a perm); o_proj's residual slot sum with xw_scatter writes
xw[:, perm] and the same h and squares; gate_up's slot sum with scatter (silu_mul or not)
writes y[:, perm]; a GEMV told its x is in row order gives, from x[:, perm], the bits it
gives from x through its gather (normed, residual and plain); bad scatters are refused."""

from __future__ import annotations

import pytest
import torch

from helpers.quant_weights import make_weight
from helpers.triton_cpu import require_triton as _require_triton
from helpers.triton_cpu import seeded_randn as _rand
from kernels.quant_matmul import quant_matmul_triton
from kernels.quant_matmul.gemv import launch_gemv
from kernels.quant_matmul.norm_fold import quant_matmul_normed, quant_matmul_residual
from kernels.quant_matmul.split_k import row_order

EPS = 1e-5


def _in_row_order(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x[..., perm]: what the GEMV's row i reads, as a contiguous tensor."""
    return x[..., perm.long()].contiguous()


def test_row_order_is_perms_inverse(device: str) -> None:
    qw = make_weight(96, 40, [4], device=device, seed=4)
    assert qw.perm is not None
    order = row_order(qw)
    assert order is not None and order.dtype == torch.int32 and order.device == qw.perm.device
    assert torch.equal(qw.perm[order.long()].cpu(), torch.arange(96, dtype=torch.int32))
    assert torch.equal(order[qw.perm.long()].cpu(), torch.arange(96, dtype=torch.int32))
    assert row_order(qw) is order  # computed once per weight
    assert row_order(make_weight(96, 40, [4], perm=False, device=device)) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2])
def test_the_mlp_in_row_order_gives_the_same_bits(dtype: torch.dtype, M: int, device: str) -> None:
    """o_proj's residual slot sum -> gate_up (silu_mul) -> down_proj's residual slot sum, once
    with every x stored and read through the gather and once in row order: h, the squares
    and the final xw equal bit for bit, the scattered intermediates are the plain ones
    permuted, and the GEMVs' results equal. k, n of different sizes and bit widths so
    that every perm is distinct; n = 2 * 80 leaves partial column tiles."""
    _require_triton(device)
    d, inner = 96, 80
    qw_o = make_weight(64, d, [4, 3], device=device, seed=1)
    qw_gate_up = make_weight(d, 2 * inner, [5, 4], device=device, seed=2)
    qw_down = make_weight(inner, d, [6, 4], device=device, seed=3)
    x = _rand((M, 64), dtype, device, seed=4, scale=0.5)
    residual = _rand((M, d), dtype, device, seed=5, scale=2.0)
    w_post = _rand((d,), dtype, device, seed=6, scale=0.3) + 1
    w_next = _rand((d,), dtype, device, seed=7, scale=0.3) + 1
    gate_up_order, down_order = row_order(qw_gate_up), row_order(qw_down)
    assert gate_up_order is not None and down_order is not None

    h, squares, xw = quant_matmul_residual(x, qw_o, residual, w_post)
    h_s, squares_s, xw_s = quant_matmul_residual(
        x, qw_o, residual, w_post, xw_scatter=gate_up_order
    )
    assert xw is not None and xw_s is not None
    assert torch.equal(h_s, h) and torch.equal(squares_s.sums, squares.sums)
    assert torch.equal(xw_s, _in_row_order(xw, qw_gate_up.perm))

    hidden = quant_matmul_normed(xw, squares, EPS, qw_gate_up, dtype, silu_mul=True)
    hidden_s = quant_matmul_normed(
        xw_s, squares, EPS, qw_gate_up, dtype, silu_mul=True, x_in_row_order=True,
        scatter=down_order,
    )  # fmt: skip
    assert torch.equal(hidden_s, _in_row_order(hidden, qw_down.perm))

    out, out_squares, out_xw = quant_matmul_residual(hidden, qw_down, h, w_next)
    out_s, out_squares_s, out_xw_s = quant_matmul_residual(
        hidden_s, qw_down, h, w_next, x_in_row_order=True
    )
    assert torch.equal(out_s, out) and torch.equal(out_squares_s.sums, out_squares.sums)
    assert torch.equal(out_xw_s, out_xw)


@pytest.mark.parametrize("M", [1, 2])
def test_a_plain_gemv_in_row_order(M: int, device: str) -> None:
    """launch_gemv without a norm: x[:, perm] read in row order equals the gathered x's
    result, and a scatter of its output (no silu_mul) stores y[:, perm of the reader]."""
    _require_triton(device)
    qw = make_weight(128, 72, [4], device=device, seed=8)
    reader = make_weight(72, 16, [3], device=device, seed=9)
    x = _rand((M, 128), torch.float16, device, seed=10)
    want = quant_matmul_triton(x, qw, path="gemv")
    y = torch.empty_like(want)
    launch_gemv(_in_row_order(x, qw.perm), qw, y, x_in_row_order=True)
    assert torch.equal(y, want)
    scattered = torch.empty_like(want)
    launch_gemv(x, qw, scattered, scatter=row_order(reader))
    assert torch.equal(scattered, _in_row_order(want, reader.perm))


def test_bad_scatters_are_refused(device: str) -> None:
    _require_triton(device)
    qw = make_weight(64, 32, [4], device=device, seed=11)
    x = _rand((1, 64), torch.float16, device, seed=12)
    y = torch.empty(1, 32, dtype=torch.float16, device=device)
    for bad in (
        torch.arange(32, device=device),  # int64
        torch.arange(31, dtype=torch.int32, device=device),  # short
        torch.arange(64, dtype=torch.int32, device=device)[::2],  # not contiguous
    ):
        with pytest.raises(ValueError, match="scatter must be a contiguous int32"):
            launch_gemv(x, qw, y, scatter=bad)
    residual = _rand((1, 32), torch.float16, device, seed=13)
    order = torch.arange(32, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="xw_scatter places xw"):
        quant_matmul_residual(x, qw, residual, xw_scatter=order)
