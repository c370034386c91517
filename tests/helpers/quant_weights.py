"""Random quantized weights in the kernels' runtime layout (kernels/quant_matmul.py), for the
kernel tests and the LoRA graph tests."""

from __future__ import annotations

import torch

from engine.quant.bitpack import make_segment
from kernels.quant_matmul import QuantizedWeight


def split_even(items: list[int], parts: int) -> list[list[int]]:
    """`items` cut into `parts` contiguous, non-empty runs of near-equal length."""
    assert 1 <= parts <= len(items)
    bounds = [round(i * len(items) / parts) for i in range(parts + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts)]


def make_weight(
    k: int,
    n: int,
    widths: list[int],
    *,
    group_size: int = 32,
    group_sizes: list[int] | None = None,
    perm: bool = True,
    bias: bool = True,
    seed: int = 0,
    device: str = "cpu",
) -> QuantizedWeight:
    """A random QuantizedWeight: codes packed by engine.quant.bitpack, fp16 scales and zeros.

    Groups are `group_sizes` (rows each, summing to k) or `group_size` rows with a short
    last one; the segments (one per entry of `widths`, in that order) take whole groups,
    as EXL2 does. Scales are about 2^(1 - bits) and zeros about half the code range times
    the scale, so that every width gives weights of order one.
    """
    generator = torch.Generator().manual_seed(seed)
    if group_sizes is None:
        group_sizes = [group_size] * (k // group_size) + (
            [k % group_size] if k % group_size else []
        )
    assert sum(group_sizes) == k
    group_ids = list(range(len(group_sizes)))
    starts = [sum(group_sizes[:g]) for g in group_ids]

    segments = []
    scales = torch.empty(len(group_sizes), n)
    zeros = torch.empty(len(group_sizes), n)
    for bits, groups in zip(widths, split_even(group_ids, len(widths)), strict=True):
        row_start = starts[groups[0]]
        rows = sum(group_sizes[g] for g in groups)
        codes = torch.randint(0, 1 << bits, (rows, n), generator=generator)
        segments.append(make_segment(codes, bits, row_start))
        scale = (0.5 + torch.rand(len(groups), n, generator=generator)) * 2.0 ** (1 - bits)
        half_range = 2 ** (bits - 1) + torch.randn(len(groups), n, generator=generator)
        scales[groups] = scale
        zeros[groups] = half_range * scale
    row_group = torch.repeat_interleave(
        torch.arange(len(group_sizes)), torch.tensor(group_sizes)
    ).to(torch.int32)
    qw = QuantizedWeight(
        in_features=k,
        out_features=n,
        perm=torch.randperm(k, generator=generator).to(torch.int32) if perm else None,
        segments=segments,
        scales=scales.half(),
        zeros=zeros.half(),
        row_group=row_group,
        bias=torch.randn(n, generator=generator).half() if bias else None,
    )
    qw.validate()
    return qw.to(device)
