"""Attention over a paged KV cache, for prefill chunks and batched decode alike.

Contract (shapes):
    q            [T, Hq, D]       new tokens of B sequences, concatenated; float16/bfloat16/
                                  float32 (rows and heads may be strided)
    k_cache      [P, S, Hk, D]    P pages of S token slots (v_cache the same), q's dtype;
                 [P, S, Hk, R]    uint8 byte rows for a quantized storage format (k_format /
                                  v_format, kernels.kv_quant: fp8, int8, int6, int4; K and V
                                  may differ, and then so do R and strides)
    cu_seqlens   [B+1] int        q rows of sequence b are cu_seqlens[b]:cu_seqlens[b+1]
    context_lens [B] int          tokens of sequence b in the cache, the new ones included
    page_table   [B, maxpages]    page ids of sequence b, in order (int32/int64)
    returns      [T, Hq, D]       in q's dtype

The new tokens of a sequence are its last tokens: query i of sequence b sits at position
context_lens[b] - n_b + i and sees keys at positions <= its own (and, with a sliding window
W, > position - W). Scores are q.k * scale, soft-capped as cap * tanh(score / cap) when
`softcap` is set (before masking). Hq must be a multiple of Hk (grouped-query attention).

Quantized storage is dequantized inside the kernels, tile by tile, never into a full copy.
Rotated formats (int8/int4: a Hadamard rotation per group of dims, see kernels.kv_quant)
are read as stored: q is rotated before the kernel and, for V, the output after it.

`paged_attention` dispatches: Triton on CUDA tensors, `paged_attention_reference` (torch)
otherwise; `backend=` forces one. The Triton path takes

  - the decode kernel (kernels/attention/decode.py: flash-decoding, split-K over the
    context) when every sequence has at most one new token, and
  - the prefill kernel (kernels/attention/prefill.py: flash attention over pages, any
    chunk lengths, several sequences per launch) otherwise.

Host syncs. Telling the two apart needs the longest query; sizing the decode split-K needs
the longest context. The engine knows both on the host when it builds the batch and passes
them as `max_query_len` / `max_context_len` (Python ints), so a decode step launches
without reading a GPU tensor (and can be captured in a CUDA graph: pass a fixed bound per
batch bucket, since the launch grid depends on it). Left as None, `max_query_len` is read
from cu_seqlens (one device sync) and `max_context_len` is bounded by the page table's
width times the page size (no sync, possibly more split programs than needed).
"""

from __future__ import annotations

import torch

from kernels.attention.decode import decode_attention
from kernels.attention.prefill import prefill_attention
from kernels.backend import Backend, resolve_backend
from kernels.kv_quant import (
    NATIVE,
    KVFormat,
    check_cache_tensor,
    dequantize_rows,
    rotate,
    rotate_native,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
# Q, K and V tiles of D_pad columns live in registers/shared memory; 256 is Gemma's.
_MAX_HEAD_DIM = 256


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_format: KVFormat = NATIVE,
    v_format: KVFormat = NATIVE,
) -> torch.Tensor:
    """Dense attention over the gathered (and, for quantized storage, dequantized and
    un-rotated) K/V rows of each sequence, in float32."""
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    group = num_q_heads // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, k_cache.shape[-1])
    v_flat = v_cache.view(-1, num_kv_heads, v_cache.shape[-1])

    def gather(flat: torch.Tensor, slots: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
        rows = flat[slots]  # [ctx, Hk, D] or [ctx, Hk, R] bytes
        if not fmt.quantized:
            return rows.float()
        values = dequantize_rows(rows.reshape(-1, rows.shape[-1]), fmt, head_dim)
        if fmt.rotated:
            values = rotate(values, fmt.group_size(head_dim))  # H is its own inverse
        return values.view(len(slots), num_kv_heads, head_dim)

    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    lens = context_lens.tolist()
    for b in range(len(lens)):
        q_start, q_end = cu[b], cu[b + 1]
        n_new, ctx = q_end - q_start, lens[b]
        if n_new == 0:
            continue
        key_pos = torch.arange(ctx, device=q.device)
        slots = page_table[b, key_pos // page_size].long() * page_size + key_pos % page_size
        k = gather(k_flat, slots, k_format).repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = gather(v_flat, slots, v_format).repeat_interleave(group, dim=1)
        qb = q[q_start:q_end].float()  # [n, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - n_new, ctx, device=q.device)
        visible = key_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= key_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def _check_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    page_table: torch.Tensor,
    sliding_window: int | None,
    softcap: float | None,
    k_format: KVFormat = NATIVE,
    v_format: KVFormat = NATIVE,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    for name, cache, fmt in (("k_cache", k_cache, k_format), ("v_cache", v_cache, v_format)):
        if cache.dim() != 4:
            raise ValueError(f"{name} must be [P, S, Hk, D], got {tuple(cache.shape)}")
        if fmt.quantized:
            check_cache_tensor(cache, fmt, head_dim, name)
        else:
            if cache.dtype != q.dtype:
                raise ValueError(f"the cache dtype must be q's ({q.dtype}), got {cache.dtype}")
            if cache.shape[3] != head_dim:
                raise ValueError(f"q head dim {head_dim} differs from the cache's {cache.shape[3]}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache and v_cache must both be [P, S, Hk, ...] of equal P, S, Hk, got "
            f"{tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    if k_format == v_format and (
        k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride()
    ):
        # The kernels share one set of slot offsets between K and V of one format, and
        # copying a cache to make it dense would cost more than the attention itself.
        raise ValueError("k_cache and v_cache of one format must have equal shapes and strides")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have a dense last dim")
    num_kv_heads = k_cache.shape[2]
    if not 0 < head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {_MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    batch = context_lens.shape[0] if context_lens.dim() == 1 else -1
    if batch < 0 or cu_seqlens.shape != (batch + 1,) or page_table.dim() != 2:
        raise ValueError(
            "expected cu_seqlens [B+1], context_lens [B] and page_table [B, maxpages], got "
            f"{tuple(cu_seqlens.shape)}, {tuple(context_lens.shape)}, {tuple(page_table.shape)}"
        )
    if page_table.shape[0] != batch:
        raise ValueError(f"page_table has {page_table.shape[0]} rows for B={batch}")
    for name, t in (("cu_seqlens", cu_seqlens), ("context_lens", context_lens)):
        if t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if page_table.dtype not in _INDEX_DTYPES:
        raise ValueError(f"page_table must be int32 or int64, got {page_table.dtype}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    decode_split_tokens: int | None = None,
    decode_dot: bool | None = None,
    k_format: KVFormat = NATIVE,
    v_format: KVFormat = NATIVE,
) -> torch.Tensor:
    """The Triton path; same contract as `paged_attention_reference`.

    `max_query_len` / `max_context_len`: see the module docstring (None costs a sync for
    the first, a loose bound for the second). `decode_split_tokens` forces keys per decode
    split (a huge value turns split-K off) and `decode_dot` the decode kernel's tl.dot or
    broadcast path: tuning and test overrides, not for the engine.
    """
    _check_args(
        q, k_cache, v_cache, cu_seqlens, context_lens, page_table, sliding_window, softcap,
        k_format, v_format,
    )  # fmt: skip
    head_dim = q.shape[-1]
    if k_format.rotated:
        q = rotate_native(q, k_format.group_size(head_dim))
    if q.stride(-1) != 1:
        q = q.contiguous()
    cu_seqlens = cu_seqlens.contiguous()
    context_lens = context_lens.contiguous()
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    if max_query_len is None:
        batch = context_lens.shape[0]
        max_query_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if batch else 0
    common = dict(
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        k_format=k_format,
        v_format=v_format,
    )
    args = (q, k_cache, v_cache, cu_seqlens, context_lens, page_table)
    if max_query_len <= 1:
        if max_context_len is None:
            max_context_len = page_table.shape[1] * k_cache.shape[1]
        out = decode_attention(
            *args,
            **common,
            max_context_len=max_context_len,
            split_tokens=decode_split_tokens,
            dot=decode_dot,
        )
    else:
        out = prefill_attention(*args, **common)
    if v_format.rotated:
        out = rotate_native(out, v_format.group_size(head_dim))
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    backend: Backend = "auto",
    k_format: KVFormat = NATIVE,
    v_format: KVFormat = NATIVE,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the paged cache; Triton on CUDA, the reference otherwise.

    `max_query_len` (the most new tokens of any sequence; an upper bound works, but <= 1
    claims a decode batch) and `max_context_len` (a bound of context_lens; it only sizes
    the decode split-K) are host-side ints the engine passes to keep decode free of device
    syncs; the reference ignores them. `k_format` / `v_format` name the cache's storage
    (kernels.kv_quant; the engine's cache knows them).
    """
    tensors = (q, k_cache, v_cache, cu_seqlens, context_lens, page_table)
    if resolve_backend(backend, *tensors) == "triton":
        return paged_attention_triton(
            *tensors,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
            max_query_len=max_query_len,
            max_context_len=max_context_len,
            k_format=k_format,
            v_format=v_format,
        )
    return paged_attention_reference(
        *tensors,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        k_format=k_format,
        v_format=v_format,
    )
