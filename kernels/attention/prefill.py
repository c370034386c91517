"""Triton prefill attention over the paged KV cache: query chunks of any length, many
sequences in one launch (chunked prefill and mixed prefill/decode batches).

Contract: `kernels.attention.paged_attention`'s (see kernels/attention/paged.py). Callers
validate the arguments; this module only launches. q [T, Hq, D], caches [P, S, Hk, D],
cu_seqlens [B+1], context_lens [B], page_table [B, maxpages]; output [T, Hq, D] in q's
dtype.

Design (flash attention 2 over pages). A query tile is BLOCK_Q consecutive tokens of one
sequence times the G = Hq/Hk query heads of one kv head: BLOCK_M = BLOCK_Q * G rows (padded
to a power of two) that share every K/V tile, so K/V is read once per kv head rather than
once per query head, and a short chunk still fills the tensor-core rows. Grid:
(query blocks of all sequences, Hk). Sequence b owns the blocks from cu_seqlens[b] //
BLOCK_Q + b on, which bounds the total by T // BLOCK_Q + B without reading cu_seqlens on the
host (no sync); a program finds its sequence by binary search and spare programs exit.

Query i of sequence b sits at position ctx - n + i. Keys up to the tile's first position
need no causal mask (first loop); the rest up to its last position are masked (second
loop); nothing above the diagonal is read. A sliding window W starts the key range at
first position - W + 1 and masks key > position - W per row. Softcap applies before the
masks. Scores are in log2 units; P is rounded to V's dtype for the PV product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.tiles import (
    INTERPRETED,
    kv_token_offsets,
    load_kv_tile,
    mma,
    score_constants,
    scores_log2,
    storage_constants,
)
from kernels.backend import cast_rtne, device_guard
from kernels.kv_quant import NATIVE, KVFormat


@triton.jit
def _attend_keys(
    acc,
    row_max,
    row_sum,
    q,
    q_pos,  # [BLOCK_M] position of each row
    key_start,
    key_end,  # keys in [key_start, key_end) are read (key_end <= context length)
    k_head_ptr,
    v_head_ptr,
    page_table_row,
    stride_kv_page,
    stride_kv_slot,
    stride_v_page,
    stride_v_slot,
    score_scale,
    softcap_log2,
    window,
    dims,
    dim_mask,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIAGONAL: tl.constexpr,  # False: whole blocks, all keys <= every row's position
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    F32_OPERANDS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    K_KIND: tl.constexpr,
    K_CODE_BYTES: tl.constexpr,
    K_GROUP: tl.constexpr,
    V_KIND: tl.constexpr,
    V_CODE_BYTES: tl.constexpr,
    V_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    dtype = q.dtype
    for block_start in range(key_start, key_end, BLOCK_N):
        key_pos = block_start + tl.arange(0, BLOCK_N)
        # Off the diagonal every key of the block exists and is visible (but for the
        # window): no key masks on the loads or the scores there.
        key_mask = (key_pos < key_end) if DIAGONAL else (key_pos >= 0)
        offsets = kv_token_offsets(
            page_table_row, key_pos, key_mask, stride_kv_page, stride_kv_slot, PAGE_SIZE
        )
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = load_kv_tile(
            k_head_ptr,
            offsets,
            dims,
            kv_mask,
            dtype,
            K_KIND,
            K_CODE_BYTES,
            K_GROUP,
            key_mask,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
        )  # [BLOCK_N, BLOCK_D]
        s = scores_log2(mma(q, tl.trans(k), F32_OPERANDS), score_scale, softcap_log2, SOFTCAP)
        if DIAGONAL:
            # Keys past the last row's position are masked here too (key_end - 1 is it).
            s = tl.where(key_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        if WINDOW:
            s = tl.where(key_pos[None, :] > q_pos[:, None] - window, s, float("-inf"))

        max_new = tl.maximum(row_max, tl.max(s, axis=1))
        alpha = tl.exp2(row_max - max_new)
        p = tl.exp2(s - max_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        if V_KIND != K_KIND:  # V rows of another format have their own size
            offsets = kv_token_offsets(
                page_table_row, key_pos, key_mask, stride_v_page, stride_v_slot, PAGE_SIZE
            )
        v = load_kv_tile(
            v_head_ptr,
            offsets,
            dims,
            kv_mask,
            dtype,
            V_KIND,
            V_CODE_BYTES,
            V_GROUP,
            key_mask,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
        )
        acc = acc * alpha[:, None] + mma(cast_rtne(p, dtype, EMULATE_BF16), v, F32_OPERANDS)
        row_max = max_new
    return acc, row_max, row_sum


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    page_table_ptr,
    stride_q_tok,
    stride_q_head,
    stride_out_tok,
    stride_out_head,
    stride_kv_page,
    stride_kv_slot,
    stride_kv_head,
    stride_v_page,
    stride_v_slot,
    stride_v_head,
    stride_pt_seq,
    num_seqs,
    score_scale,
    softcap_log2,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # tokens per tile; BLOCK_Q * GROUP <= BLOCK_M
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    F32_OPERANDS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    K_KIND: tl.constexpr,
    K_CODE_BYTES: tl.constexpr,
    K_GROUP: tl.constexpr,
    V_KIND: tl.constexpr,
    V_CODE_BYTES: tl.constexpr,
    V_GROUP: tl.constexpr,
):
    block = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The last sequence whose first block is <= this one (first block of b is cu[b] //
    # BLOCK_Q + b, strictly increasing in b).
    # Tensors from the start: loop-carried values must keep one type (and num_seqs == 1
    # arrives as a constexpr).
    lo_seq = block * 0
    hi_seq = lo_seq + num_seqs
    while lo_seq + 1 < hi_seq:
        mid = (lo_seq + hi_seq) // 2
        mid_first = tl.load(cu_seqlens_ptr + mid) // BLOCK_Q + mid
        lo_seq = tl.where(mid_first <= block, mid, lo_seq)
        hi_seq = tl.where(mid_first <= block, hi_seq, mid)
    seq = lo_seq

    q_start = tl.load(cu_seqlens_ptr + seq)
    n_new = (tl.load(cu_seqlens_ptr + seq + 1) - q_start).to(tl.int32)
    first_token = (block - (q_start // BLOCK_Q + seq)).to(tl.int32) * BLOCK_Q
    if first_token < n_new:
        dtype = q_ptr.dtype.element_ty
        ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
        rows = tl.arange(0, BLOCK_M)
        token = first_token + rows // GROUP
        row_mask = (rows < BLOCK_Q * GROUP) & (token < n_new)
        heads = kv_head * GROUP + rows % GROUP
        q_pos = ctx - n_new + token  # [BLOCK_M]
        first_pos = ctx - n_new + first_token
        last_pos = ctx - n_new + tl.minimum(first_token + BLOCK_Q, n_new) - 1

        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        io_mask = row_mask[:, None] & dim_mask[None, :]
        q_rows = (q_start + token).to(tl.int64)
        q_ptrs = q_ptr + q_rows[:, None] * stride_q_tok + heads[:, None] * stride_q_head
        q = tl.load(q_ptrs + dims[None, :], mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

        page_table_row = page_table_ptr + seq.to(tl.int64) * stride_pt_seq
        k_head_ptr = k_cache_ptr + kv_head * stride_kv_head
        v_head_ptr = v_cache_ptr + kv_head * stride_v_head
        row_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        key_lo = 0
        if WINDOW:
            key_lo = tl.maximum(first_pos - window + 1, 0)
        # Whole blocks at or below the first row's position: visible to every row.
        diag_start = key_lo + (first_pos + 1 - key_lo) // BLOCK_N * BLOCK_N
        acc, row_max, row_sum = _attend_keys(
            acc, row_max, row_sum, q, q_pos, key_lo, diag_start, k_head_ptr, v_head_ptr,
            page_table_row, stride_kv_page, stride_kv_slot, stride_v_page, stride_v_slot,
            score_scale, softcap_log2, window, dims, dim_mask, PAGE_SIZE, BLOCK_N,
            False, WINDOW, SOFTCAP, F32_OPERANDS, EMULATE_BF16,
            K_KIND, K_CODE_BYTES, K_GROUP, V_KIND, V_CODE_BYTES, V_GROUP, HEAD_DIM, BLOCK_D,
        )  # fmt: skip
        # The diagonal: the rest up to the last row's position, causally masked.
        acc, row_max, row_sum = _attend_keys(
            acc, row_max, row_sum, q, q_pos, diag_start, last_pos + 1, k_head_ptr, v_head_ptr,
            page_table_row, stride_kv_page, stride_kv_slot, stride_v_page, stride_v_slot,
            score_scale, softcap_log2, window, dims, dim_mask, PAGE_SIZE, BLOCK_N,
            True, WINDOW, SOFTCAP, F32_OPERANDS, EMULATE_BF16,
            K_KIND, K_CODE_BYTES, K_GROUP, V_KIND, V_CODE_BYTES, V_GROUP, HEAD_DIM, BLOCK_D,
        )  # fmt: skip

        out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]
        out_ptrs = out_ptr + q_rows[:, None] * stride_out_tok + heads[:, None] * stride_out_head
        tl.store(out_ptrs + dims[None, :], cast_rtne(out, dtype, EMULATE_BF16), mask=io_mask)


def _prefill_config(group: int, block_d: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), FA2-style tiles for H100/H200."""
    if dtype == torch.float32:
        # A debugging dtype: tf32x3 dots triple the operand registers, so small tiles (the
        # largest that ptxas fits without spills at D=128).
        block_m, block_n, num_warps, num_stages = 32, (32 if block_d <= 128 else 16), 4, 2
    elif block_d <= 128:
        block_m, block_n, num_warps, num_stages = 128, 64, 8, 3
    else:
        block_m, block_n, num_warps, num_stages = 64, 32, 4, 2
    # Every query tile holds at least one token's whole head group.
    return max(block_m, triton.next_power_of_2(group)), block_n, num_warps, num_stages


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    k_format: KVFormat = NATIVE,
    v_format: KVFormat = NATIVE,
) -> torch.Tensor:
    """Prefill (any number of new tokens per sequence); arguments already validated."""
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = context_lens.shape[0]
    group = num_q_heads // num_kv_heads
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0:
        return out

    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps, num_stages = _prefill_config(group, block_d, q.dtype)
    block_q = block_m // group
    score_scale, softcap_log2 = score_constants(scale, softcap)
    grid = (num_tokens // block_q + batch, num_kv_heads)
    with device_guard(q):
        _prefill_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            cu_seqlens,
            context_lens,
            page_table,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            page_table.stride(0),
            batch,
            score_scale,
            softcap_log2,
            sliding_window or 0,
            GROUP=group,
            HEAD_DIM=head_dim,
            PAGE_SIZE=page_size,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            WINDOW=sliding_window is not None,
            SOFTCAP=softcap is not None,
            F32_OPERANDS=INTERPRETED or q.dtype == torch.float32,
            EMULATE_BF16=INTERPRETED,
            **storage_constants(k_format, v_format, head_dim),
            num_warps=num_warps,
            num_stages=num_stages,
        )
    return out
