"""kernels.lora_matmul: the reference against float64 math written out row by row, and the
Triton kernel (interpreted on the CPU, compiled on a GPU) against the reference."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.lora_matmul import lora_matmul, lora_matmul_reference, lora_matmul_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (segment lengths, K, N, rank): decode rows, a prefill chunk past one row tile, empty
# segments, ranks that are not powers of two, widths that are not multiples of the tiles.
CASES = [
    ([1, 1, 1, 1], 64, 48, 8),
    ([1, 1, 1, 0, 1], 600, 300, 16),  # decode kernel: several K and column tiles
    ([1, 1, 1], 200, 80, 64),  # decode kernel at a high rank: narrower K tiles
    ([1, 0, 1, 1], 3000, 40, 5),  # decode: 12 K splits summed under a 16-wide mask
    ([3, 0, 5, 1], 72, 40, 12),
    ([70, 1, 2], 96, 136, 16),
    ([2, 2], 40, 24, 3),
]


def _require_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (unset on GPU machines)")


def _inputs(lengths: list[int], k: int, n: int, rank: int, dtype: torch.dtype, device: str):
    """Three stacked adapters, four slots (slot 1 has no LoRA on this layer); segment 0 uses
    slot 0, segment 1 two slots at once, segment 2 none (all zero), the rest slot 3."""
    gen = torch.Generator().manual_seed(sum(lengths) + k + n + rank)
    t = sum(lengths)
    x = torch.randn(t, k, generator=gen).to(dtype)
    y = torch.randn(t, n, generator=gen).to(dtype)
    a = (torch.randn(3, rank, k, generator=gen) / k**0.5).to(dtype)
    b = (torch.randn(3, n, rank, generator=gen) / rank**0.5).to(dtype)
    slot_map = torch.tensor([2, -1, 0, 1], dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    scales = torch.zeros(len(lengths), 4)
    for g in range(len(lengths)):
        if g == 0:
            scales[g, 0] = 1.0
        elif g == 1:
            scales[g, 2], scales[g, 3] = 0.5, -0.75
            scales[g, 1] = 3.0  # slot 1 is not on this layer: ignored
        elif g >= 3:
            scales[g, 3] = 1.5
    to = dict(device=device)
    return (
        y.to(**to),
        x.to(**to),
        a.to(**to),
        b.to(**to),
        slot_map.to(**to),
        starts.to(**to),
        scales.to(**to),
    )


def _float64(y, x, a, b, slot_map, starts, scales) -> torch.Tensor:
    out = y.double().clone()
    bounds = starts.tolist()
    for g in range(scales.shape[0]):
        for s, local in enumerate(slot_map.tolist()):
            scale = scales[g, s].item()
            if local < 0 or scale == 0:
                continue
            rows = slice(bounds[g], bounds[g + 1])
            out[rows] += scale * (x[rows].double() @ a[local].double().t()) @ b[local].double().t()
    return out


@pytest.mark.parametrize("lengths,k,n,rank", CASES)
def test_reference_matches_float64(lengths, k, n, rank):
    args = _inputs(lengths, k, n, rank, torch.float32, "cpu")
    want = _float64(*args)
    got = lora_matmul_reference(args[0].clone(), *args[1:], max_seg_len=max(lengths))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # Rows of the segment without adapters are left exactly as they were.
    rows = slice(sum(lengths[:2]), sum(lengths[:3]))
    assert torch.equal(got[rows], args[0][rows])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths,k,n,rank", CASES)
def test_triton_matches_reference(lengths, k, n, rank, dtype, device):
    _require_triton(device)
    y, *rest = _inputs(lengths, k, n, rank, dtype, device)
    want = lora_matmul_reference(y.clone(), *rest, max_seg_len=max(lengths))
    got = lora_matmul_triton(y.clone(), *rest, max_seg_len=max(lengths))
    # Rows of the segment without adapters come back bit for bit.
    rows = slice(sum(lengths[:2]), sum(lengths[:3]))
    assert torch.equal(got[rows], y[rows])
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert not torch.equal(got, y)


def test_strided_output_and_dispatch(device):
    """y may be a column slice of a wider buffer (a padded quantized output); the
    dispatcher takes the reference on CPU tensors unless Triton is forced."""
    y, x, a, b, slot_map, starts, scales = _inputs([2, 3, 1], 32, 40, 4, torch.float32, device)
    wide = torch.zeros(y.shape[0], 64, device=device)
    wide[:, :40] = y
    want = lora_matmul_reference(y.clone(), x, a, b, slot_map, starts, scales, max_seg_len=3)
    backends = ["torch", "auto"]
    if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        backends.append("triton")
    for backend in backends:
        view = wide.clone()[:, :40]
        lora_matmul(view, x, a, b, slot_map, starts, scales, max_seg_len=3, backend=backend)
        torch.testing.assert_close(view, want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_named():
    y, x, a, b, slot_map, starts, scales = _inputs([2, 1], 32, 40, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        lora_matmul(y, x[:, :16], a, b, slot_map, starts, scales, max_seg_len=2)
    with pytest.raises(ValueError, match="seg_starts must have G\\+1 = 3"):
        lora_matmul(y, x, a, b, slot_map, starts[:2], scales[:2], max_seg_len=2)
    with pytest.raises(ValueError, match="share a float dtype"):
        lora_matmul(y.half(), x, a, b, slot_map, starts, scales, max_seg_len=2)


@pytest.mark.parametrize("gemv_first", [True, False], ids=["gemv_first", "expand_first"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2])
def test_expand_into_gemv(m, dtype, gemv_first, device):
    """The decode expand as extra programs of the quantized GEMV (GemvShare): in either
    launch order, once the slot sum has run, y = round(x @ W + bias + LoRA delta),
    whatever the workspace's slots held before (NaN here: the expand writes its whole slot,
    zeros where it adds nothing). The adapters cover 200 of the 256 (padded) columns."""
    _require_triton(device)
    from helpers.quant_weights import make_weight
    from kernels.lora_matmul import lora_expand_into_gemv, lora_shrink
    from kernels.quant_matmul import quant_matmul_reference
    from kernels.quant_matmul.gemv_share import (
        finish_gemv_shared,
        gemv_share,
        launch_gemv_shared,
    )

    qw = make_weight(320, 256, [4, 3], device=device, seed=3)
    lengths = [1] * m
    _, x, a, b, slot_map, starts, scales = _inputs(lengths, 320, 200, 12, dtype, device)
    if m == 2:
        scales[1] = torch.tensor([0.0, 0.0, 0.5, -0.75], device=device)  # two slots at once
    want = quant_matmul_reference(x.float(), qw)
    want[:, :200] = lora_matmul_reference(
        want[:, :200].clone(), x.float(), a.float(), b.float(), slot_map, starts, scales,
        max_seg_len=1,
    )  # fmt: skip
    for _ in range(2):  # the second call finds the workspace as the first left it
        share = gemv_share(x, qw)
        assert share is not None and share.tiling.grouped
        assert share.slots == share.tiling.arrivals + 1 == share.extra_slot + 1
        share.sums.fill_(float("nan"))
        partials = lora_shrink(x, a, slot_map, starts, scales)
        if gemv_first:
            launch_gemv_shared(x, qw, share)
        lora_expand_into_gemv(share, partials, b, slot_map, starts, scales)
        if not gemv_first:
            launch_gemv_shared(x, qw, share)
        finish_gemv_shared(share)
        tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        torch.testing.assert_close(share.y.float(), want, rtol=tol, atol=tol)


def test_gemv_share_declines_other_paths():
    """Rows past the GEMV's limit take the dot path: no share, the caller expands alone."""
    from helpers.quant_weights import make_weight
    from kernels.quant_matmul.gemv_share import gemv_share
    from kernels.quant_matmul.paths import GEMV_MAX_M

    qw = make_weight(64, 128, [4])
    assert gemv_share(torch.randn(GEMV_MAX_M + 1, 64), qw) is None
    share = gemv_share(torch.randn(1, 64), qw)
    assert share is not None and share.slots == share.tiling.arrivals + 1
