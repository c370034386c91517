"""Partials of simulated tensor-parallel ranks for the all-reduce kernels' tests
(tests/kernels/test_tp_all_reduce.py, test_tp_push_all_reduce.py), and their sum in the
order the kernels add them."""

from __future__ import annotations

import torch


def order_sensitive_partials(
    world: int, rows: int, hidden: int, seed: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Every rank's float32 [rows, hidden] partial, rank r's scaled by 10**r.

    Column 0 is where the order of the float32 sum shows after the cast to `dtype`: rank 0
    holds a tie of the 16-bit format (1 + half its ulp), the others half a float32 ulp of 1
    each. In rank order each addition is a float32 tie that stays at rank 0's value (even),
    and the cast rounds the tie down to 1; from the last rank down, the small ones first add
    up to a whole ulp, and the sum rounds up."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(rows, hidden, generator=g) * (10.0**r) for r in range(world)]
    half_ulp16 = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    parts[0][:, 0] = 1.0 + half_ulp16
    for p in parts[1:]:
        p[:, 0] = 2.0**-24
    return parts


def rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """rank 0's partial + rank 1's + ...: the kernels' float32 sum."""
    total = parts[0].clone()
    for p in parts[1:]:
        total = total + p
    return total
