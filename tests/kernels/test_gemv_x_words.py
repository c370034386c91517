"""The decode GEMV's x read in 8-byte words (kernels/quant_matmul/gemv.py, `_gemv_x_chunk`
with VEC_X, issue 28): two float32 or four fp16/bf16 rows of x per load, split back into
rows in every thread. It is taken only where it is exact to do so (`reads_x_in_words`:
contiguous rows, whole chunks, one group per chunk, x 8-byte aligned); everywhere else x is
loaded a row at a time.

What is tested, through the interpreter on CPU (and compiled on a GPU): the choice itself,
and that the GEMV gives, from an aligned x (read in words) and from the same values at an
address off by one element (read a row at a time), the reference's result and, on CPU, the
same bits: a word split into rows in the wrong order, or a row dropped, differs. One and
two bit planes, one to four rows of x, each dtype of x."""

from __future__ import annotations

import pytest
import torch

from helpers.quant_weights import make_weight
from helpers.triton_cpu import require_triton as _require_triton
from helpers.triton_cpu import seeded_randn as _rand
from kernels.quant_matmul import quant_matmul_reference
from kernels.quant_matmul.gemv import gemv_tiling, launch_gemv, reads_x_in_words

TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 5e-3, torch.float32: 1e-5}


def _off_by_one(x: torch.Tensor) -> torch.Tensor:
    """x's values at an address one element past an 8-byte boundary (unit column stride)."""
    buffer = torch.empty(x.shape[0], x.shape[1] + 2, dtype=x.dtype, device=x.device)
    view = buffer[:, 1 : 1 + x.shape[1]]
    view.copy_(x)
    return view


def _gemv(x: torch.Tensor, qw) -> torch.Tensor:
    y = torch.empty(x.shape[0], qw.out_features, dtype=torch.float32, device=x.device)
    launch_gemv(x, qw, y)
    return y


def test_the_choice_of_words() -> None:
    qw = make_weight(256, 64, [4], perm=False, bias=False)
    x = torch.zeros(1, 256)
    t = gemv_tiling(x, qw)
    assert t.grouped and 256 % (t.iters * t.block_k) == 0
    assert reads_x_in_words(x, 0, 256, t, gather=False)
    assert not reads_x_in_words(x, 0, 256, t, gather=True)  # through perm: a row at a time
    assert not reads_x_in_words(_off_by_one(x), 0, 256, t, gather=False)
    assert not reads_x_in_words(x, 1, 255, t, gather=False)  # a segment off the boundary
    assert not reads_x_in_words(x, 0, 256 - t.block_k, t, gather=False)  # a partial split
    assert reads_x_in_words(torch.zeros(3, 256, dtype=torch.float16), 0, 256, t, gather=False)
    # rows 8-byte aligned: a row stride of 258 halves (516 bytes) is not
    rows = torch.zeros(3, 258, dtype=torch.float16)[:, :256]
    assert not reads_x_in_words(rows, 0, 256, t, gather=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("widths", [[4], [6]], ids=["one_plane", "two_planes"])
@pytest.mark.parametrize("M", [1, 2, 4])
def test_x_in_words_gives_the_rows_it_packs(
    device: str, dtype: torch.dtype, widths: list[int], M: int
) -> None:
    _require_triton(device)
    qw = make_weight(256, 96, widths, perm=False, seed=3, device=device)
    x = _rand((M, 256), dtype, device, seed=5, scale=1.0)
    unaligned = _off_by_one(x)
    t = gemv_tiling(x, qw)
    assert reads_x_in_words(x, 0, 256, t, gather=False)
    assert not reads_x_in_words(unaligned, 0, 256, t, gather=False)
    in_words, by_rows = _gemv(x, qw), _gemv(unaligned, qw)
    ref = quant_matmul_reference(x.float(), qw).float()
    for out in (in_words, by_rows):
        err = (out - ref).norm() / ref.norm()
        assert err < TOLERANCE[dtype], f"relative error {err:.2e}"
    if device == "cpu":
        assert torch.equal(in_words, by_rows)
    else:  # compiled: the two loads may lay x out differently for the sum of the zero term
        torch.testing.assert_close(in_words, by_rows, rtol=1e-5, atol=1e-4)
