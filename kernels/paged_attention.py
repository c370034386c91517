"""Attention over a paged KV cache, for prefill chunks and batched decode alike.

Contract (shapes):
    q            [T, Hq, D]       new tokens of B sequences, concatenated
    k_cache      [P, S, Hk, D]    P pages of S token slots (v_cache the same)
    cu_seqlens   [B+1] int        q rows of sequence b are cu_seqlens[b]:cu_seqlens[b+1]
    context_lens [B] int          tokens of sequence b in the cache, the new ones included
    page_table   [B, maxpages]    page ids of sequence b, in order
    returns      [T, Hq, D]       in q's dtype

The new tokens of a sequence are its last tokens: query i of sequence b sits at position
context_lens[b] - n_b + i and sees keys at positions <= its own (and, with a sliding window
W, > position - W). Hq must be a multiple of Hk (grouped-query attention).

Only the torch reference exists so far; the Triton decode and prefill kernels arrive with
the generator (continuous batching) and the dispatcher already routes through here.
"""

from __future__ import annotations

import torch


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
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    group = num_q_heads // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
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
        k = k_flat[slots].float().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = v_flat[slots].float().repeat_interleave(group, dim=1)
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
) -> torch.Tensor:
    return paged_attention_reference(
        q,
        k_cache,
        v_cache,
        cu_seqlens,
        context_lens,
        page_table,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
    )
