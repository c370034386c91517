"""Token bitmasks applied to logits: what constrained decoding allows, before the samplers.

Contract (logits [B, V] float32/float16/bfloat16, bitmask [R, W] int32 with W * 32 >= V
bits, rows int64 [N] indices into logits, N <= R):

    allowed(r, t) = (bitmask[r, t // 32] >> (t % 32)) & 1      # bit t of mask row r
    logits[rows[r], t] = -inf  wherever not allowed(r, t)        # in place

so mask row r applies to logits row rows[r]; other logits rows are untouched. This is the
layout llguidance writes (one bit per token, little-endian within each 32-bit word).
`apply_token_bitmask` changes `logits` in place and returns it; Triton on CUDA tensors,
the reference otherwise (see kernels.backend).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import Backend, device_guard, resolve_backend

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 1024  # tokens per program: 32 mask words


def _check_args(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        raise ValueError(f"logits must be [B, V] float, got {list(logits.shape)} {logits.dtype}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be [R, W] int32, got {list(bitmask.shape)} {bitmask.dtype}")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"bitmask has {bitmask.shape[1] * 32} bits per row, logits {logits.shape[1]} tokens"
        )
    if rows.dim() != 1 or rows.dtype != torch.int64 or rows.shape[0] > bitmask.shape[0]:
        raise ValueError(f"rows must be int64 [N] with N <= {bitmask.shape[0]}")


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    _check_args(logits, bitmask, rows)
    n, vocab = rows.shape[0], logits.shape[1]
    if n == 0:
        return logits
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:n].unsqueeze(-1) >> shifts) & 1  # [N, W, 32]
    allowed = bits.reshape(n, -1)[:, :vocab].bool()
    picked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    logits.index_copy_(0, rows, picked)
    return logits


@triton.jit
def _bitmask_kernel(
    logits_ptr, mask_ptr, rows_ptr, vocab, logits_stride, mask_stride, BLOCK: tl.constexpr
):
    r = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    row = tl.load(rows_ptr + r)
    tokens = start + tl.arange(0, BLOCK)
    inside = tokens < vocab
    words = tl.load(mask_ptr + r * mask_stride + tokens // 32, mask=inside, other=-1)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    ptrs = logits_ptr + row * logits_stride + tokens
    # Only the masked-out entries are written: a mostly open mask costs few stores.
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), tl.float32), mask=inside & ~allowed)


def apply_token_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    _check_args(logits, bitmask, rows)
    if rows.shape[0] == 0:
        return logits
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    vocab = logits.shape[1]
    grid = (rows.shape[0], triton.cdiv(vocab, _BLOCK))
    with device_guard(logits):
        _bitmask_kernel[grid](
            logits, bitmask, rows, vocab, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK
        )
    return logits


def apply_token_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Set logits[rows[r], t] to -inf where bit t of bitmask[r] is 0 (in place)."""
    if resolve_backend(backend, logits, bitmask, rows) == "triton":
        return apply_token_bitmask_triton(logits, bitmask, rows)
    return apply_token_bitmask_reference(logits, bitmask, rows)
