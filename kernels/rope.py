"""Rotary position embedding, NeoX / transformers "rotate_half" layout, partial rotary allowed.

Contract (out of place; outputs are new contiguous tensors in the input dtype):

    q [T, Hq, D], k [T, Hk, D]      float32/float16/bfloat16, same dtype; tokens and heads may
                                     be strided (views into a fused QKV output are read in place)
    positions [T]                   int32/int64, each in [0, max_pos)
    cos, sin [max_pos, R/2]         float tables (float32 from engine.rope), R = 2 * R/2 <= D

For token t with angles row p = positions[t] and h = R/2, per head:

    c = cat(cos[p], cos[p]).to(x.dtype);  s = cat(sin[p], sin[p]).to(x.dtype)
    x[:R] = x[:R] * c + rotate_half(x[:R]) * s      # rotate_half(a, b) = (-b, a), halves of R
    x[R:] unchanged

with every product and the sum in x.dtype, which is what transformers' apply_rotary_pos_emb
computes. The Triton kernel does its math in float32 but rounds where the reference rounds
(the tables to x.dtype, each product, the sum) and is compiled without fused multiply-adds,
so it matches the reference bit for bit in every dtype, on the GPU and in the interpreter
(products of two float16/bfloat16 values are exact in float32, so rounding them afterwards
equals torch's 16-bit multiply). Tests still compare with a couple of ulps of tolerance.

`apply_rope_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots)` is the same rotation
fused with the write of a native (model-dtype) paged KV cache [pages, page_size, Hk, D]: the
rotated k and the unchanged v of token t land at flat slot slots[t], and only q comes back.
Both are one kernel (`_rope_kernel`, WRITE_CACHE on or off), so the cached keys equal
apply_rope's bit for bit.

Positions outside the tables are an error in the reference (checked there, which syncs on
a GPU); the Triton kernel does not check them (only under TRITON_DEBUG), as a check would
cost a device sync per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import (
    Backend,
    cast_rtne,
    device_guard,
    is_interpreted,
    pdl_launch_dependents,
    pdl_wait,
    programmatic_launch,
    resolve_backend,
)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Elements per half-rotation tile, [heads, R/2]: 16 heads of Llama's 64 (D=128) per program.
_TILE_ELEMENTS = 1024


def _check_args(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        raise ValueError(
            f"q and k must share one of float32/float16/bfloat16, got {q.dtype} and {k.dtype}"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same T, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head dims differ: {q.shape[2]} and {k.shape[2]}")
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be a 1-D int32/int64 tensor, got {positions.dtype} "
            f"{tuple(positions.shape)}"
        )
    if positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions has {positions.shape[0]} entries for T={q.shape[0]}")
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must both be [max_pos, R/2], got {tuple(cos.shape)} and "
            f"{tuple(sin.shape)}"
        )
    if not (cos.is_floating_point() and sin.is_floating_point()):
        raise ValueError(f"cos and sin must be floating tables, got {cos.dtype} and {sin.dtype}")
    # R = 2 * cos.shape[-1] is even by construction; it must fit in the head.
    rotary_dims = 2 * cos.shape[1]
    if rotary_dims > q.shape[2]:
        raise ValueError(f"rotary dims R={rotary_dims} exceed the head dim D={q.shape[2]}")


def _rotate_reference(
    x: torch.Tensor, cos_full: torch.Tensor, sin_full: torch.Tensor
) -> torch.Tensor:
    # x [T, H, D]; cos_full, sin_full [T, 1, R] in x.dtype
    rotary_dims = cos_full.shape[-1]
    half = rotary_dims // 2
    x_rot, x_pass = x[..., :rotary_dims], x[..., rotary_dims:]
    rotated_half = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos_full + rotated_half * sin_full, x_pass], dim=-1)


def apply_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in plain torch with transformers' numerics; returns new (q_rot, k_rot)."""
    _check_args(q, k, positions, cos, sin)
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
        raise ValueError(
            f"positions must lie in [0, {cos.shape[0]}), got "
            f"[{int(positions.min())}, {int(positions.max())}]"
        )
    index = positions.long()
    cos_rows, sin_rows = cos[index], sin[index]  # [T, R/2]
    cos_full = torch.cat([cos_rows, cos_rows], dim=-1).to(q.dtype)[:, None, :]  # [T, 1, R]
    sin_full = torch.cat([sin_rows, sin_rows], dim=-1).to(q.dtype)[:, None, :]  # [T, 1, R]
    return _rotate_reference(q, cos_full, sin_full), _rotate_reference(k, cos_full, sin_full)


@triton.jit
def rotate_halves(x1, x2, cos, sin, x_dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """The rotated halves (x1 * cos - x2 * sin, x2 * cos + x1 * sin) in x_dtype, x1 and x2
    values of x_dtype held in float32, cos and sin rounded to x_dtype (`rope_angles`): each
    product and the sum rounded to x_dtype, as the reference computes them in that dtype.
    Shared with the decode GEMV's slot sum that rotates q and k itself
    (kernels/quant_matmul/slot_sum_rope.py), so both give these bits."""
    x1_cos = cast_rtne(x1 * cos, x_dtype, EMULATE_BF16).to(tl.float32)
    x2_sin = cast_rtne(x2 * sin, x_dtype, EMULATE_BF16).to(tl.float32)
    x2_cos = cast_rtne(x2 * cos, x_dtype, EMULATE_BF16).to(tl.float32)
    x1_sin = cast_rtne(x1 * sin, x_dtype, EMULATE_BF16).to(tl.float32)
    out1 = cast_rtne(x1_cos - x2_sin, x_dtype, EMULATE_BF16)
    out2 = cast_rtne(x2_cos + x1_sin, x_dtype, EMULATE_BF16)
    return out1, out2


@triton.jit
def _rope_heads(
    x_ptr,  # token t's row of q or k
    out_ptr,  # token t's row of the output
    x_head_stride,
    out_head_stride,
    first_head,
    n_heads,
    cos,  # [1, BLOCK_HALF] float32, already rounded to the activation dtype
    sin,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    x_dtype = x_ptr.dtype.element_ty
    heads = first_head + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    head_mask = heads < n_heads
    cols = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    mask = head_mask & (cols < HALF)
    x_head = x_ptr + heads * x_head_stride
    out_head = out_ptr + heads * out_head_stride

    x1 = tl.load(x_head + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_head + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    out1, out2 = rotate_halves(x1, x2, cos, sin, x_dtype, EMULATE_BF16)
    tl.store(out_head + cols, out1, mask=mask)
    tl.store(out_head + HALF + cols, out2, mask=mask)

    if PASS > 0:
        # Out of place, so the dims past R must be copied too.
        pass_cols = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
        pass_mask = head_mask & (pass_cols < 2 * HALF + PASS)
        tl.store(out_head + pass_cols, tl.load(x_head + pass_cols, mask=pass_mask), mask=pass_mask)


@triton.jit
def rope_angles(
    positions_ptr,
    token,
    cos_ptr,
    sin_ptr,
    cos_row_stride,
    sin_row_stride,
    max_pos,
    x_dtype: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """cos and sin [1, BLOCK_HALF] of `token`'s position, rounded to the activation dtype
    (transformers casts the float32 tables before multiplying) and held in float32."""
    position = tl.load(positions_ptr + token).to(tl.int64)
    tl.device_assert((position >= 0) & (position < max_pos), "position outside the rope tables")
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    table_mask = cols < HALF
    cos = tl.load(cos_ptr + position * cos_row_stride + cols, mask=table_mask, other=0.0)
    sin = tl.load(sin_ptr + position * sin_row_stride + cols, mask=table_mask, other=0.0)
    cos = cast_rtne(cos.to(tl.float32), x_dtype, EMULATE_BF16).to(tl.float32)
    sin = cast_rtne(sin.to(tl.float32), x_dtype, EMULATE_BF16).to(tl.float32)
    return cos, sin


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,  # WRITE_CACHE only (else a dummy)
    q_out_ptr,
    k_out_ptr,  # rotated k: [T, Hk, D], or the native cache's flat slots (WRITE_CACHE)
    v_out_ptr,  # WRITE_CACHE: the v cache's flat slots, k_out's strides (else a dummy)
    positions_ptr,
    slots_ptr,  # WRITE_CACHE: k_out's row of each token (else a dummy)
    cos_ptr,
    sin_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    q_out_token_stride,
    q_out_head_stride,
    k_out_row_stride,
    k_out_head_stride,
    cos_row_stride,
    sin_row_stride,
    n_q_heads,
    n_k_heads,
    max_pos,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    WRITE_CACHE: tl.constexpr,  # k into slots[t] of a native cache, v copied beside it
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels.backend)
):
    # Everything this kernel reads comes from earlier kernels: wait before any load.
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    # Grid: (T, q head blocks + k head blocks). q and k share one launch and one table read
    # per program; int64 token offsets because T * stride passes 2**31 in long prefills.
    # With WRITE_CACHE a k block's program also copies the v heads of the same block, so v
    # adds no programs; the rotation is the same code either way, so the cached keys equal
    # apply_rope's bit for bit.
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    x_dtype = q_ptr.dtype.element_ty
    cos, sin = rope_angles(
        positions_ptr,
        token,
        cos_ptr,
        sin_ptr,
        cos_row_stride,
        sin_row_stride,
        max_pos,
        x_dtype,
        HALF,
        BLOCK_HALF,
        EMULATE_BF16,
    )
    n_q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    if head_block < n_q_blocks:
        _rope_heads(
            q_ptr + token * q_token_stride,
            q_out_ptr + token * q_out_token_stride,
            q_head_stride,
            q_out_head_stride,
            head_block * BLOCK_H,
            n_q_heads,
            cos,
            sin,
            HALF,
            PASS,
            BLOCK_H,
            BLOCK_HALF,
            BLOCK_PASS,
            EMULATE_BF16,
        )
    else:
        if WRITE_CACHE:
            row = tl.load(slots_ptr + token).to(tl.int64)
        else:
            row = token
        first_head = (head_block - n_q_blocks) * BLOCK_H
        _rope_heads(
            k_ptr + token * k_token_stride,
            k_out_ptr + row * k_out_row_stride,
            k_head_stride,
            k_out_head_stride,
            first_head,
            n_k_heads,
            cos,
            sin,
            HALF,
            PASS,
            BLOCK_H,
            BLOCK_HALF,
            BLOCK_PASS,
            EMULATE_BF16,
        )
        if WRITE_CACHE:
            heads = first_head + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
            dims = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
            mask = (heads < n_k_heads) & (dims < HEAD_DIM)
            v = tl.load(v_ptr + token * v_token_stride + heads * v_head_stride + dims, mask=mask)
            tl.store(
                v_out_ptr + row * k_out_row_stride + heads * k_out_head_stride + dims, v, mask=mask
            )


# Triton 3.6's interpreter truncates float32 -> bfloat16: see kernels.backend.cast_rtne.
_INTERPRETED = is_interpreted(_rope_kernel)


def apply_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE through the Triton kernel; same contract as `apply_rope_reference`."""
    _check_args(q, k, positions, cos, sin)
    T, n_q_heads, D = q.shape
    n_k_heads = k.shape[1]
    q_out = torch.empty((T, n_q_heads, D), dtype=q.dtype, device=q.device)
    k_out = torch.empty((T, n_k_heads, D), dtype=k.dtype, device=k.device)
    if T == 0 or D == 0 or n_q_heads + n_k_heads == 0:
        return q_out, k_out
    # The kernel indexes the last dim densely; heads and tokens may be strided.
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    positions = positions.contiguous()

    half = cos.shape[1]
    n_pass = D - 2 * half
    block_half = triton.next_power_of_2(max(half, 1))
    block_h = min(
        triton.next_power_of_2(max(n_q_heads, n_k_heads)),
        max(1, _TILE_ELEMENTS // block_half),
    )
    grid = (T, triton.cdiv(n_q_heads, block_h) + triton.cdiv(n_k_heads, block_h))
    with device_guard(q):
        _rope_kernel[grid](
            q,
            k,
            k,  # no v
            q_out,
            k_out,
            k_out,  # no v
            positions,
            positions,  # no slots
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            k.stride(0),  # no v
            k.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            cos.stride(0),
            sin.stride(0),
            n_q_heads,
            n_k_heads,
            cos.shape[0],
            HALF=half,
            PASS=n_pass,
            HEAD_DIM=D,
            BLOCK_H=block_h,
            BLOCK_HALF=block_half,
            BLOCK_PASS=triton.next_power_of_2(max(n_pass, 1)),
            BLOCK_D=triton.next_power_of_2(D),
            EMULATE_BF16=_INTERPRETED,
            WRITE_CACHE=False,
            USE_PDL=False,
            num_warps=4,
            # No fused multiply-adds: with them ~20% of outputs differed from the reference by
            # an ulp in every dtype (H200). Free here: the kernel is memory-bound.
            enable_fp_fusion=False,
        )
    return q_out, k_out


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by the table rows at positions [T].

    Returns new tensors; Triton on CUDA, the torch reference otherwise.
    """
    if resolve_backend(backend, q, k, positions, cos, sin) == "triton":
        return apply_rope_triton(q, k, positions, cos, sin)
    return apply_rope_reference(q, k, positions, cos, sin)


# ---------------------------------------------------------------------------------------------
# RoPE + KV cache write for a native (model-dtype) paged cache: q is rotated into a new
# tensor, k is rotated straight into its cache slot and v copied into its slot, in one launch.
# Unfused, that is the rope launch plus two index_copy_ launches per layer.


def _check_write_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(
            f"v must match k ({k.dtype} {tuple(k.shape)}), got {v.dtype} {tuple(v.shape)}"
        )
    T, n_k_heads, D = k.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        shape_ok = cache.dim() in (3, 4) and cache.shape[-2:] == (n_k_heads, D)
        if not shape_ok or cache.dtype != k.dtype:
            raise ValueError(
                f"{name} must be a native cache [pages, page_size, {n_k_heads}, {D}] or its "
                f"flat slots [slots, {n_k_heads}, {D}] of {k.dtype}, got {cache.dtype} "
                f"{tuple(cache.shape)}"
            )
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous (it is written in place)")
    if slots.shape != (T,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slots must be int32/int64 [T={T}], got {slots.dtype} {tuple(slots.shape)}"
        )


def apply_rope_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """apply_rope, then rotated k and v stored at flat slots of the native caches (the
    unfused path's ops); returns the rotated q."""
    _check_args(q, k, positions, cos, sin)
    _check_write_args(k, v, k_cache, v_cache, slots)
    q_rot, k_rot = apply_rope_reference(q, k, positions, cos, sin)
    index = slots.long()
    k_cache.view(-1, *k_cache.shape[-2:]).index_copy_(0, index, k_rot)
    v_cache.view(-1, *v_cache.shape[-2:]).index_copy_(0, index, v)
    return q_rot


def apply_rope_write_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """RoPE + native cache write in one Triton launch; same contract as the reference."""
    _check_args(q, k, positions, cos, sin)
    _check_write_args(k, v, k_cache, v_cache, slots)
    T, n_q_heads, D = q.shape
    n_k_heads = k.shape[1]
    q_out = torch.empty((T, n_q_heads, D), dtype=q.dtype, device=q.device)
    if T == 0 or D == 0 or n_q_heads + n_k_heads == 0:
        return q_out
    # The kernel indexes the last dim densely; heads and tokens may be strided.
    q, k, v, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, cos, sin))
    positions, slots = positions.contiguous(), slots.contiguous()
    k_flat = k_cache.view(-1, n_k_heads, D)
    v_flat = v_cache.view(-1, n_k_heads, D)

    half = cos.shape[1]
    n_pass = D - 2 * half
    block_half = triton.next_power_of_2(max(half, 1))
    block_h = min(
        triton.next_power_of_2(max(n_q_heads, n_k_heads)),
        max(1, _TILE_ELEMENTS // block_half),
    )
    grid = (T, triton.cdiv(n_q_heads, block_h) + triton.cdiv(n_k_heads, block_h))
    pdl = programmatic_launch(q)
    with device_guard(q):
        _rope_kernel[grid](
            q,
            k,
            v,
            q_out,
            k_flat,
            v_flat,
            positions,
            slots,
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_flat.stride(0),
            k_flat.stride(1),
            cos.stride(0),
            sin.stride(0),
            n_q_heads,
            n_k_heads,
            cos.shape[0],
            HALF=half,
            PASS=n_pass,
            HEAD_DIM=D,
            BLOCK_H=block_h,
            BLOCK_HALF=block_half,
            BLOCK_PASS=triton.next_power_of_2(max(n_pass, 1)),
            BLOCK_D=triton.next_power_of_2(D),
            EMULATE_BF16=_INTERPRETED,
            WRITE_CACHE=True,
            num_warps=4,
            enable_fp_fusion=False,  # as in apply_rope_triton: the reference's roundings
            USE_PDL=pdl,
            launch_pdl=pdl,
        )
    return q_out


def apply_rope_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Rotate q and k as `apply_rope` does, store rotated k and v [T, Hk, D] at flat `slots`
    [T] of the native caches k_cache, v_cache (in place: [pages, page_size, Hk, D], or the
    flat slots [slots, Hk, D] of engine.cache with its scratch slot), and
    return the rotated q [T, Hq, D]. Triton on CUDA (one launch), the reference otherwise."""
    tensors = (q, k, v, positions, cos, sin, k_cache, v_cache, slots)
    if resolve_backend(backend, *tensors) == "triton":
        return apply_rope_write_triton(*tensors)
    return apply_rope_write_reference(*tensors)
