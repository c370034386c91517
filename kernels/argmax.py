"""The greedy token of each logits row: argmax over a large vocabulary in two short kernels.

Contract (logits [N, V] float32/float16/bfloat16, rows contiguous along V):

    argmax_rows(logits)[n] == logits[n].argmax()   # int64 [N], torch's answer exactly

torch's own argmax reduces a row of a 128k vocabulary in one thread block (29 µs of a 2.07
ms 8B decode step on an H200, issue 28). Here each row is cut into parts of `_PART` tokens:
the first kernel gives every part its own program (the row's first maximum and where it is),
the second picks each row's first best part, so the row is read at the GPU's bandwidth.

torch's rules, kept: the first index of the maximum wins a tie; a NaN counts as larger than
anything (the first NaN wins); a row of -inf answers 0. Triton on CUDA tensors, torch
otherwise (kernels.backend).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import Backend, device_guard, resolve_backend

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 1024  # tokens a program reads per iteration
_PART = 2048  # tokens a first-kernel program reduces: 63 programs a row of 128,256


def _check_args(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        raise ValueError(f"logits must be [N, V] float, got {list(logits.shape)} {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("logits have no tokens (V = 0): there is no argmax")


@triton.jit
def _first_best(x, idx, BIG: tl.constexpr):
    """(best, where, any_nan) of one block: its largest value and the first index holding
    it, or, where the block holds a NaN, the first NaN's index (torch's argmax ranks NaN
    above everything). Lanes outside the data carry -inf and an index past every real
    one. Both kernels reduce with it: a block of a row, and a row's parts."""
    nan = x != x
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    first_nan = tl.min(tl.where(nan, idx, BIG), axis=0)
    v = tl.where(nan, float("-inf"), x)
    best = tl.max(v, axis=0)
    where = tl.min(tl.where(v == best, idx, BIG), axis=0)
    return best, tl.where(any_nan, first_nan, where), any_nan


@triton.jit
def _argmax_parts_kernel(
    x_ptr, row_stride, vocab, best_ptr, where_ptr, nan_ptr, parts,
    PART: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    part = tl.program_id(1)
    start = part * PART
    BIG: tl.constexpr = 2**31 - 1
    # A part's answer starts at its first token: a part of -inf answers its first index.
    best = tl.full([], float("-inf"), tl.float32)
    where = start
    seen_nan = best != best  # False, as a tensor: `~` on a Python bool is -1
    for off in tl.static_range(0, PART, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        # int64 row offsets: a batch of long rows (or a strided view) passes 2^31 elements.
        x = tl.load(
            x_ptr + row.to(tl.int64) * row_stride + idx, mask=idx < vocab, other=float("-inf")
        )
        b, w, n = _first_best(x.to(tl.float32), idx, BIG)
        # Blocks come in index order, so only a strictly larger value (or a first NaN)
        # moves the answer: ties keep the earlier index.
        take = ~seen_nan & (n | (b > best))
        best = tl.where(take, b, best)
        where = tl.where(take, w, where)
        seen_nan = seen_nan | n
    out = row.to(tl.int64) * parts + part
    tl.store(best_ptr + out, best)
    tl.store(where_ptr + out, where)
    tl.store(nan_ptr + out, seen_nan.to(tl.int8))


@triton.jit
def _argmax_rows_kernel(
    best_ptr, where_ptr, nan_ptr, parts, out_ptr, PARTS: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0)
    BIG: tl.constexpr = 2**31 - 1
    p = tl.arange(0, PARTS)
    ok = p < parts
    first = row.to(tl.int64) * parts
    best = tl.load(best_ptr + first + p, mask=ok, other=float("-inf"))
    where = tl.load(where_ptr + first + p, mask=ok, other=BIG)
    nan = tl.load(nan_ptr + first + p, mask=ok, other=0) != 0
    # A part that saw a NaN holds its first NaN's index: as a NaN it outranks the others.
    # Parts hold disjoint, ascending index ranges, so the first best part's index is the
    # row's first maximum (a row of -inf: part 0's first index).
    _, where_best, _ = _first_best(tl.where(nan, float("nan"), best), where, BIG)
    tl.store(out_ptr + row, where_best.to(tl.int64))


def argmax_rows_triton(logits: torch.Tensor) -> torch.Tensor:
    _check_args(logits)
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous along the vocabulary")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    parts = triton.cdiv(vocab, _PART)
    best = torch.empty(rows * parts, dtype=torch.float32, device=logits.device)
    where = torch.empty(rows * parts, dtype=torch.int32, device=logits.device)
    nan = torch.empty(rows * parts, dtype=torch.int8, device=logits.device)
    with device_guard(logits):
        _argmax_parts_kernel[(rows, parts)](
            logits, logits.stride(0), vocab, best, where, nan, parts, PART=_PART, BLOCK=_BLOCK
        )
        _argmax_rows_kernel[(rows,)](
            best, where, nan, parts, out, PARTS=triton.next_power_of_2(parts)
        )
    return out


def argmax_rows(logits: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """int64 [N]: each row's argmax, as `logits.argmax(dim=-1)` gives it. A row that is not
    contiguous along V takes torch's path unless Triton is asked for."""
    path = resolve_backend(backend, logits)
    if path == "triton" and (backend == "triton" or logits.stride(-1) == 1):
        return argmax_rows_triton(logits)
    return logits.argmax(dim=-1)
