"""Triton decode attention over the paged KV cache (flash-decoding).

Contract: `kernels.attention.paged_attention`'s (see kernels/attention/paged.py), restricted
to batches where every sequence has at most one new token. Callers validate the arguments;
this module only launches. Shapes as there: q [T, Hq, D], caches [P, S, Hk, D], cu_seqlens
[B+1], context_lens [B], page_table [B, maxpages]; output [T, Hq, D] in q's dtype.

Design. Grid (B, Hk, splits): a program takes one sequence, one kv head and one contiguous
chunk of that sequence's keys, and computes all G = Hq/Hk query heads of the group at once,
so every K/V byte is read once per step. Long contexts at small batch are split into
chunks ("split-K") so that B * Hk * splits programs fill the GPU; each split writes its
output over its own keys (float32) and their log-sum-exp, and the last split of a (sequence,
kv head) to finish (an int32 counter each) merges the group's splits weighted by their
log-sum-exps, in split order: one launch per step, where a second merge kernel cost ~2 µs
per layer on an H100. With one split the program writes the output itself. Scores are kept
in log2 units (exp2 is the fast path).

Query tiles: G rows of D. For G >= `DECODE_DOT_MIN_GROUP` the rows are padded to 16 and
multiplied with tl.dot (tensor cores; the padding costs nothing in a memory-bound kernel);
below that a broadcast-multiply-and-sum in float32 avoids a mostly empty MMA.

The K/V load is `load_kv_tile` (kernels/attention/tiles.py, shared with the prefill
kernel): the one place that knows how the cache stores a token. The
quantized storage formats (fp8, int8, int4; kernels.kv_quant) are dequantized there, tile by
tile in registers, from byte rows that carry their own scales; K and V each have a format
(K_KIND / V_KIND) and their own strides, so a type may store them differently.
"""

from __future__ import annotations

import functools

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
from kernels.backend import (
    cast_rtne,
    device_guard,
    pdl_launch_dependents,
    pdl_wait,
    programmatic_launch,
)
from kernels.kv_quant import NATIVE, KVFormat

# Groups at least this large use tl.dot with rows padded to 16; smaller ones (MHA, G=2) the
# float32 broadcast product. Measure G=4/8 both ways on the GPU (`dot=` of decode_attention).
DECODE_DOT_MIN_GROUP = 4
# Fewest keys per split in the plan: one key block. The kernel spreads the actual context
# over the planned splits, so a split gets at least a block whenever there are keys for it;
# at 512 keys the step's attention is then a handful of one-block programs, not two
# programs walking four blocks each.
MIN_SPLIT_TOKENS = 64
MAX_SPLITS = 128
# Programs aimed for, per SM: enough resident programs to hide the gather latency.
PROGRAMS_PER_SM = 3
# Per device: int32 counters, one per (sequence, kv head), of the splits that have written
# their part; zero between calls (the merging program resets its own). They only grow; a
# replaced buffer is kept alive, since a CUDA graph captured earlier still counts in it.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []


def _merge_counters(device: torch.device, count: int) -> torch.Tensor:
    have = _COUNTERS.get(device)
    if have is None or have.numel() < count:
        if have is not None:
            _RETIRED_COUNTERS.append(have)
        size = max(count, 2 * have.numel() if have is not None else 0, 1024)
        have = _COUNTERS[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return have


# Software-pipelining depth of the decode kernel's key-block loop. One stage (no
# prefetch into shared memory) was 6% faster than two on average over batch 1-64 and
# 128-8192 keys, 13% at batch 1 with 8192 (H100, fp16 8B shapes,
# bench/results/2026-11-25-h100-mid-m-fold-and-decode-attention-s8.json):
# the resident programs hide the gather latency better than a deeper pipeline does.
DECODE_NUM_STAGES = 1


# ---------------------------------------------------------------------------------------------
# Decode kernels.


@triton.jit
def _load_kv_block(
    page_table_row,
    k_head_ptr,
    v_head_ptr,
    key_pos,
    key_mask,
    dims,
    dim_mask,
    dtype,
    stride_kv_page,
    stride_kv_slot,
    stride_v_page,
    stride_v_slot,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_KIND: tl.constexpr,
    K_CODE_BYTES: tl.constexpr,
    K_GROUP: tl.constexpr,
    V_KIND: tl.constexpr,
    V_CODE_BYTES: tl.constexpr,
    V_GROUP: tl.constexpr,
):
    """The [BLOCK_N, BLOCK_D] K and V tiles of the keys at `key_pos` where `key_mask`
    (0 elsewhere), through the page table, in q's dtype."""
    offsets = kv_token_offsets(
        page_table_row, key_pos, key_mask, stride_kv_page, stride_kv_slot, PAGE_SIZE
    )
    kv_mask = key_mask[:, None] & dim_mask[None, :]
    k = load_kv_tile(
        k_head_ptr, offsets, dims, kv_mask, dtype, K_KIND, K_CODE_BYTES, K_GROUP, key_mask,
        HEAD_DIM, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    if V_KIND != K_KIND:  # V rows of another format have their own size
        offsets = kv_token_offsets(
            page_table_row, key_pos, key_mask, stride_v_page, stride_v_slot, PAGE_SIZE
        )
    v = load_kv_tile(
        v_head_ptr, offsets, dims, kv_mask, dtype, V_KIND, V_CODE_BYTES, V_GROUP, key_mask,
        HEAD_DIM, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    return k, v


@triton.jit
def _attend_block(
    q,
    k,
    v,
    key_mask,
    row_max,
    row_sum,
    acc,
    score_scale,
    softcap_log2,
    dtype,
    SOFTCAP: tl.constexpr,
    USE_DOT: tl.constexpr,
    F32_OPERANDS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """One key block of the online softmax: (row_max, row_sum, acc) after the keys of
    `key_mask` (scores in log2 units)."""
    if USE_DOT:
        qk = mma(q, tl.trans(k), F32_OPERANDS)
    else:
        qk = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    s = scores_log2(qk, score_scale, softcap_log2, SOFTCAP)
    s = tl.where(key_mask[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
    max_new = tl.maximum(row_max, tl.max(s, axis=1))
    alpha = tl.exp2(row_max - max_new)
    p = tl.exp2(s - max_new[:, None])
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    if USE_DOT:
        # P is rounded to V's dtype for the tensor cores, as flash attention does.
        p_lo = cast_rtne(p, dtype, EMULATE_BF16)
        acc = acc * alpha[:, None] + mma(p_lo, v, F32_OPERANDS)
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
    return max_new, row_sum, acc


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,  # [T, Hq, D] when not SPLIT
    part_out_ptr,  # [B, Hq, splits, D] float32 when SPLIT
    part_lse_ptr,  # [B, Hq, splits] float32 when SPLIT
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
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    score_scale,
    softcap_log2,
    window,
    split_tokens,  # keys per split, a multiple of BLOCK_N
    counter_ptr,  # int32 [B, Hk] zero between calls (SPLIT): splits of the group done
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,  # GROUP rounded up to a power of two (the merge's rows)
    BLOCK_S: tl.constexpr,  # splits rounded up to a power of two (the merge's lse tile)
    MERGE_CHUNK: tl.constexpr,  # splits whose outputs the merge loads at once
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr,
    SPLIT: tl.constexpr,
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
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels.backend)
):
    # What no kernel of this forward writes may be read before the wait: the batch's rows
    # (cu_seqlens, context lengths, page table: in a graph, captured torch copies at its
    # start, ordinary launches that never let a dependent start early; eager, copies before
    # the forward) and the keys and values of every token but the new one (written by
    # earlier forwards, which complete before this one starts). The new token's query, key
    # and value come from a kernel of this forward: read after the wait. So the first block's
    # old keys and values are in flight while the kernels before this one finish. A kernel
    # that writes batch rows or old cache slots inside a forward would break this.
    pdl_launch_dependents(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(cu_seqlens_ptr + seq)
    n_new = tl.load(cu_seqlens_ptr + seq + 1) - q_row
    if n_new > 0:
        dtype = q_ptr.dtype.element_ty
        ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
        # The one query sits at ctx - 1, so the window is a range of keys, not a mask.
        lo = 0
        if WINDOW:
            lo = tl.maximum(ctx - window, 0)
        # The grid's splits share this sequence's actual keys: a step captured in a CUDA
        # graph plans its splits for the longest context the graph serves, and a short
        # context would otherwise fall into the first split or two (one program walking
        # every block in turn while the others idle). split_tokens stays the most a split
        # takes.
        even = tl.cdiv(tl.cdiv(ctx - lo, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        keys = tl.minimum(split_tokens, even)
        start = lo + split * keys
        end = tl.minimum(start + keys, ctx)
        if split == tl.num_programs(2) - 1:
            # The last split takes whatever is left, so an underestimated max_context_len
            # costs speed, never keys.
            end = ctx

        g = tl.arange(0, BLOCK_G)
        heads = kv_head * GROUP + g
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        q_mask = (g < GROUP)[:, None] & dim_mask[None, :]
        page_table_row = page_table_ptr + seq.to(tl.int64) * stride_pt_seq
        k_head_ptr = k_cache_ptr + kv_head * stride_kv_head
        v_head_ptr = v_cache_ptr + kv_head * stride_v_head

        first_pos = start + tl.arange(0, BLOCK_N)
        first_keys = first_pos < end
        new_token = ctx - 1
        k, v = _load_kv_block(
            page_table_row, k_head_ptr, v_head_ptr, first_pos, first_keys & (first_pos < new_token),
            dims, dim_mask, dtype, stride_kv_page, stride_kv_slot, stride_v_page, stride_v_slot,
            PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D,
            K_KIND, K_CODE_BYTES, K_GROUP, V_KIND, V_CODE_BYTES, V_GROUP,
        )  # fmt: skip
        pdl_wait(USE_PDL)
        q_ptrs = q_ptr + q_row.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head
        q = tl.load(q_ptrs + dims[None, :], mask=q_mask, other=0.0)  # [BLOCK_G, BLOCK_D]
        if not USE_DOT:
            q = q.to(tl.float32)
        if (start <= new_token) & (new_token < tl.minimum(start + BLOCK_N, end)):
            is_new = first_pos == new_token
            k_new, v_new = _load_kv_block(
                page_table_row, k_head_ptr, v_head_ptr, first_pos, is_new,
                dims, dim_mask, dtype, stride_kv_page, stride_kv_slot, stride_v_page,
                stride_v_slot, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D,
                K_KIND, K_CODE_BYTES, K_GROUP, V_KIND, V_CODE_BYTES, V_GROUP,
            )  # fmt: skip
            k = tl.where(is_new[:, None], k_new, k)
            v = tl.where(is_new[:, None], v_new, v)

        # A finite start: rows that have seen only masked keys get weights 0, not NaN.
        row_max = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        if start < end:
            row_max, row_sum, acc = _attend_block(
                q, k, v, first_keys, row_max, row_sum, acc, score_scale, softcap_log2,
                dtype, SOFTCAP, USE_DOT, F32_OPERANDS, EMULATE_BF16,
            )  # fmt: skip
        for block_start in range(start + BLOCK_N, end, BLOCK_N):
            key_pos = block_start + tl.arange(0, BLOCK_N)
            key_mask = key_pos < end
            k, v = _load_kv_block(
                page_table_row, k_head_ptr, v_head_ptr, key_pos, key_mask,
                dims, dim_mask, dtype, stride_kv_page, stride_kv_slot, stride_v_page,
                stride_v_slot, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D,
                K_KIND, K_CODE_BYTES, K_GROUP, V_KIND, V_CODE_BYTES, V_GROUP,
            )  # fmt: skip
            row_max, row_sum, acc = _attend_block(
                q, k, v, key_mask, row_max, row_sum, acc, score_scale, softcap_log2,
                dtype, SOFTCAP, USE_DOT, F32_OPERANDS, EMULATE_BF16,
            )  # fmt: skip

        safe_sum = tl.where(row_sum > 0.0, row_sum, 1.0)
        out = acc / safe_sum[:, None]
        if SPLIT:
            # Every split writes, empty ones too (lse = -inf), so the merge needs no count.
            lse = tl.where(row_sum > 0.0, row_max + tl.log2(safe_sum), float("-inf"))
            part_row = seq.to(tl.int64) * stride_po_seq + heads * stride_po_head
            part_ptrs = part_out_ptr + (part_row + split * stride_po_split)[:, None]
            tl.store(part_ptrs + dims[None, :], out, mask=q_mask)
            lse_ptrs = part_lse_ptr + seq.to(tl.int64) * stride_pl_seq + heads * stride_pl_head
            tl.store(lse_ptrs + split, lse, mask=g < GROUP)
            # The group's last split to finish merges them all (no second kernel): the
            # barrier puts every thread's stores before the counter's release.
            tl.debug_barrier()
            counter = counter_ptr + seq * tl.num_programs(1) + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel")
            if done == tl.num_programs(2) - 1:
                _merge_group(
                    part_out_ptr, part_lse_ptr, out_ptr, seq, kv_head, q_row,
                    stride_po_seq, stride_po_head, stride_po_split, stride_pl_seq,
                    stride_pl_head, stride_out_tok, stride_out_head, tl.num_programs(2),
                    GROUP, GROUP_P2, HEAD_DIM, BLOCK_S, MERGE_CHUNK, BLOCK_D, EMULATE_BF16,
                )  # fmt: skip
                tl.store(counter, 0)
        else:
            out_ptrs = out_ptr + q_row.to(tl.int64) * stride_out_tok
            out_ptrs += heads[:, None] * stride_out_head + dims[None, :]
            tl.store(out_ptrs, cast_rtne(out, dtype, EMULATE_BF16), mask=q_mask)


@triton.jit
def _merge_group(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    seq,
    kv_head,
    q_row,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    stride_out_tok,
    stride_out_head,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """out = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max) for the GROUP query heads
    of one kv head, the splits added in split order (the same bits whichever split came
    last). Read from L2 (.cg), past an L1 that may hold lines of an earlier step."""
    g = tl.arange(0, GROUP_P2)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    lse_rows = part_lse_ptr + seq.to(tl.int64) * stride_pl_seq + heads * stride_pl_head
    splits = tl.arange(0, BLOCK_S)
    lse_all = tl.load(
        lse_rows[:, None] + splits[None, :],
        mask=head_ok[:, None] & (splits < num_splits)[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )  # [GROUP_P2, BLOCK_S]
    lse_max = tl.max(lse_all, axis=1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.sum(tl.exp2(lse_all - lse_max[:, None]), axis=1)

    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    part_rows = part_out_ptr + seq.to(tl.int64) * stride_po_seq + heads * stride_po_head
    acc = tl.zeros([GROUP_P2, BLOCK_D], dtype=tl.float32)
    for chunk_start in range(0, num_splits, CHUNK):
        chunk = chunk_start + tl.arange(0, CHUNK)
        chunk_ok = chunk < num_splits
        lse = tl.load(
            lse_rows[:, None] + chunk[None, :],
            mask=head_ok[:, None] & chunk_ok[None, :],
            other=float("-inf"),
            cache_modifier=".cg",
        )
        weight = tl.exp2(lse - lse_max[:, None])  # [GROUP_P2, CHUNK]; empty splits weigh 0
        o_ptrs = (
            part_rows[:, None, None] + chunk[None, :, None] * stride_po_split + dims[None, None, :]
        )
        o_ok = head_ok[:, None, None] & chunk_ok[None, :, None] & dim_ok[None, None, :]
        o = tl.load(o_ptrs, mask=o_ok, other=0.0, cache_modifier=".cg")
        acc += tl.sum(weight[:, :, None] * o, axis=1)
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    out_ptrs = out_ptr + q_row.to(tl.int64) * stride_out_tok + heads[:, None] * stride_out_head
    dtype = out_ptr.dtype.element_ty
    tl.store(
        out_ptrs + dims[None, :],
        cast_rtne(out, dtype, EMULATE_BF16),
        mask=head_ok[:, None] & dim_ok[None, :],
    )


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: few programs keep CPU runs short
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_splits(
    batch: int, num_kv_heads: int, key_span: int, num_sms: int, block_n: int
) -> tuple[int, int]:
    """(splits, keys per split) for a decode step.

    `key_span` bounds the keys any sequence attends to (its context, or the window). Splits
    are added until batch * kv heads * splits reaches PROGRAMS_PER_SM programs per SM, but no
    split gets fewer than MIN_SPLIT_TOKENS keys.
    """
    key_span = max(key_span, 1)
    base = max(batch * num_kv_heads, 1)
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, base)
    splits = max(1, min(wanted, triton.cdiv(key_span, MIN_SPLIT_TOKENS), MAX_SPLITS))
    return _splits_of(key_span, triton.cdiv(key_span, splits), block_n)


def _splits_of(key_span: int, split_tokens: int, block_n: int) -> tuple[int, int]:
    # Whole key blocks per split, and no split longer than the span (keeps it in int32).
    split_tokens = min(max(split_tokens, 1), key_span)
    split_tokens = triton.cdiv(split_tokens, block_n) * block_n
    return triton.cdiv(key_span, split_tokens), split_tokens


def _decode_config(
    group: int, block_d: int, use_dot: bool, dtype: torch.dtype
) -> tuple[int, int, int]:
    """(BLOCK_G, BLOCK_N, num_warps)."""
    if use_dot:
        # tl.dot needs 16 rows; 64 keys of 128 dims keep 32 KB of K+V in flight per step.
        # Splits of 2-4 blocks once took 128-key blocks on 8 warps (an H100, 2026-11-25,
        # two pipeline stages); with today's one stage that tile was slower on an H200, 8B
        # shape, one sequence: 4096 keys 13.6 against 11.0 us a layer, 8192 keys 21.2
        # against 15.4 (bench/results/2026-11-29-h200-decode-attention-tiles-s24.json).
        # float32's tf32x3 dots need half the keys to stay clear of register spills.
        block_n = (64 if block_d <= 128 else 32) // (2 if dtype == torch.float32 else 1)
        return max(16, triton.next_power_of_2(group)), block_n, 4
    block_g = triton.next_power_of_2(group)
    # The broadcast product is a [BLOCK_G, BLOCK_N, BLOCK_D] float32 tile: keep it in
    # registers (8192 elements is 64 per thread at 4 warps).
    block_n = max(16, min(64, 8192 // (block_g * block_d)))
    return block_g, block_n, 4


def decode_attention(
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
    max_context_len: int,
    split_tokens: int | None = None,
    dot: bool | None = None,
    k_format: KVFormat = NATIVE,
    v_format: KVFormat = NATIVE,
) -> torch.Tensor:
    """Decode attention (at most one new token per sequence); arguments already validated.

    `max_context_len` bounds every context length (an upper bound is fine: only the split
    plan depends on it, not correctness). `split_tokens` forces keys per split (tests,
    benchmarks; a huge value disables split-K); `dot` forces the tl.dot or the broadcast
    path.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = context_lens.shape[0]
    group = num_q_heads // num_kv_heads
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0:
        return out

    storage = storage_constants(k_format, v_format, head_dim)
    block_d = max(16, triton.next_power_of_2(head_dim))
    use_dot = group >= DECODE_DOT_MIN_GROUP if dot is None else dot
    block_g, block_n, num_warps = _decode_config(group, block_d, use_dot, q.dtype)
    key_span = max_context_len if sliding_window is None else min(max_context_len, sliding_window)
    if split_tokens is None:
        num_splits, split_tokens = plan_splits(
            batch, num_kv_heads, key_span, _num_sms(q.device), block_n
        )
    else:
        num_splits, split_tokens = _splits_of(max(key_span, 1), split_tokens, block_n)
    split = num_splits > 1

    if split:
        part_out = torch.empty(
            (batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device
        )
        counters = _merge_counters(q.device, batch * num_kv_heads)
    else:
        part_out = part_lse = out  # unused
        counters = context_lens  # unused
    group_p2 = triton.next_power_of_2(group)
    merge_chunk = max(1, min(64 // group_p2, 8192 // (group_p2 * block_d)))
    score_scale, softcap_log2 = score_constants(scale, softcap)
    pdl = programmatic_launch(q)
    with device_guard(q):
        _decode_kernel[(batch, num_kv_heads, num_splits)](
            q,
            k_cache,
            v_cache,
            out,
            part_out,
            part_lse,
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
            part_out.stride(0) if split else 0,
            part_out.stride(1) if split else 0,
            part_out.stride(2) if split else 0,
            part_lse.stride(0) if split else 0,
            part_lse.stride(1) if split else 0,
            score_scale,
            softcap_log2,
            sliding_window or 0,
            split_tokens,
            counters,
            GROUP=group,
            GROUP_P2=group_p2,
            BLOCK_S=triton.next_power_of_2(num_splits),
            MERGE_CHUNK=merge_chunk,
            HEAD_DIM=head_dim,
            PAGE_SIZE=page_size,
            BLOCK_G=block_g,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            USE_DOT=use_dot,
            SPLIT=split,
            WINDOW=sliding_window is not None,
            SOFTCAP=softcap is not None,
            F32_OPERANDS=INTERPRETED or q.dtype == torch.float32,
            EMULATE_BF16=INTERPRETED,
            **storage,
            num_warps=num_warps,
            num_stages=DECODE_NUM_STAGES,
            USE_PDL=pdl,
            launch_pdl=pdl,
        )
    return out
