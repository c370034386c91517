"""Validation helpers shared by the EXL2 and GPTQ readers.

Every failure raises QuantFormatError with a message that starts with the full tensor name
(`<module prefix>.<tensor>: ...`), so a bad file points at the tensor to look at.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch


class QuantFormatError(ValueError):
    """A quantized tensor set does not follow its on-disk format."""


def fail(name: str, tensor: str, message: str) -> NoReturn:
    raise QuantFormatError(f"{name}.{tensor}: {message}")


def check_tensor(
    name: str,
    tensor: str,
    t: torch.Tensor | None,
    dtypes: Sequence[torch.dtype],
    shape: tuple[int, ...] | None = None,
    ndim: int | None = None,
) -> torch.Tensor:
    """Require `t` to exist with one of `dtypes` and the given shape (or number of dims)."""
    if t is None:
        fail(name, tensor, "missing")
    if not isinstance(t, torch.Tensor):
        fail(name, tensor, f"expected a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        fail(name, tensor, f"dtype must be {want}, got {str(t.dtype).removeprefix('torch.')}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        fail(name, tensor, f"shape must be {list(shape)}, got {list(t.shape)}")
    if ndim is not None and t.dim() != ndim:
        fail(name, tensor, f"must have {ndim} dimension(s), got shape {list(t.shape)}")
    return t


def check_permutation(name: str, tensor: str, perm: torch.Tensor, k: int) -> None:
    """Require `perm` [k] to hold each of 0..k-1 exactly once."""
    p = perm.long()
    low, high = int(p.min()), int(p.max())
    if low < 0 or high >= k:
        fail(name, tensor, f"not a permutation of 0..{k - 1}: values span {low}..{high}")
    counts = torch.bincount(p, minlength=k)
    if bool((counts != 1).any()):
        dup = int(torch.nonzero(counts > 1)[0, 0])
        fail(name, tensor, f"not a permutation of 0..{k - 1}: {dup} appears {int(counts[dup])}x")
