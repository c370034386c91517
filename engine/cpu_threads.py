"""torch's CPU thread count for the length of a block (a conversion, a tensor-parallel
rank's read and cut of its shard), the caller's count restored after.

    with cpu_threads(4):
        ...
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def cpu_threads(count: int) -> Iterator[None]:
    """torch uses `count` threads inside the block; the caller's count is restored after,
    also when the block raises."""
    if count <= 0:
        raise ValueError(f"threads must be positive, got {count}")
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
