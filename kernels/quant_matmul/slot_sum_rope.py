"""The qkv projection's slot sum with RoPE and the KV cache write in it (issue 28): a decode
step's fused qkv GEMV (kernels/quant_matmul/gemv.py) stores its split-K partials, and this
kernel, in place of the plain slot sum (slot_sum.py) and the rope + cache write kernel after
it (kernels/rope.py's `apply_rope_write`), sums each q, k and v head's partials in slot order,
scales them by the row's rstd and adds the bias where the norm is folded (SlotNorm), rounds
them to the model's dtype, rotates q and k, returns q and writes k and v into their slots of
a native (model-dtype) paged cache. One launch per layer fewer, and the [T, (Hq + 2 Hk) D]
qkv tensor is never written or read back.

Bits: each value is rounded to the dtype where the slot sum rounded qkv, and the rotation is
kernels/rope.py's `rotate_halves` on those values with `rope_angles`' tables, so q and the
cached k and v equal the unfused slot sum followed by apply_rope_write, bit for bit.

Grid: (T, Hq + Hk) programs, one head each; a kv head's program also carries the v head of
the same index. The head's halves are separate [1, R/2] tiles, so the rotation needs no
shuffle between lanes.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.backend import (
    cast_rtne,
    is_interpreted,
    pdl_launch_dependents,
    pdl_wait,
    programmatic_launch,
)
from kernels.quant_matmul.slot_sum import SlotNorm, check_slot_norm, row_rstd
from kernels.quant_matmul.tiles import sum_slots
from kernels.rope import rope_angles, rotate_halves


@dataclasses.dataclass(frozen=True)
class RopeCacheWrite:
    """Where a decode step's rotated keys and values go, and how q and k rotate: positions
    [T] and slots [T] (int32/int64: each row's position and flat cache slot), the rope
    tables cos, sin [max_pos, R/2] (float32, engine.rope), the native caches k_cache and
    v_cache ([pages, page_size, Hk, D] or flat [slots, Hk, D], the model's dtype,
    contiguous) and the head layout of the qkv output ([q heads | k heads | v heads],
    head_dim D each)."""

    positions: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def width(self) -> int:
        """The qkv projection's out_features: (Hq + 2 Hk) * D."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


@triton.jit
def _head_values(
    sums_ptr,
    elements,
    token,
    n,
    cols,  # [1, BLOCK] columns of the qkv row
    mask,
    rstd,
    bias_ptr,
    SLOTS: tl.constexpr,
    GROUP: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    x_dtype: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """The qkv values at `cols` of row `token`, as the slot sum stores them (sum in slot
    order, times rstd, plus the bias, rounded to x_dtype), held in float32."""
    total = sum_slots(sums_ptr, elements, token * n + cols, mask, SLOTS, GROUP)
    if NORM:
        total = total * rstd
    if HAS_BIAS:
        total = total + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return cast_rtne(total, x_dtype, EMULATE_BF16).to(tl.float32)


@triton.jit(do_not_specialize=["chunks", "norm_d"])
def _slot_sum_rope_kernel(
    sums_ptr,  # float32 [SLOTS, T, n]: the workspace (see store_partial)
    q_out_ptr,  # [T, Hq, D] contiguous, the model's dtype
    k_cache_ptr,  # flat slots [S, Hk, D] (row stride cache_row_stride)
    v_cache_ptr,
    positions_ptr,
    slots_ptr,
    cos_ptr,
    sin_ptr,
    bias_ptr,  # HAS_BIAS: the qkv bias [n]; else unused
    squares_ptr,  # NORM: float32 [T, chunks], the RowSquares of the hidden state
    chunks,
    norm_d,
    eps,
    n,  # (Hq + 2 Hk) * D
    elements,  # T * n: the workspace's slot stride
    cos_row_stride,
    sin_row_stride,
    cache_row_stride,
    max_pos,
    n_q_heads,
    n_kv_heads,
    SLOTS: tl.constexpr,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,  # R / 2
    PASS: tl.constexpr,  # D - R: dims past the rotary ones, copied
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
    USE_PDL: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    pdl_launch_dependents(USE_PDL)
    # The partials, the squares, positions and slots are earlier kernels' (or copies')
    # outputs: nothing is read before the wait but the tables' addresses.
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    x_dtype = q_out_ptr.dtype.element_ty
    rstd = 1.0
    if NORM:
        rstd = row_rstd(squares_ptr, chunks, norm_d, eps, token, CHUNKS_POW2)
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
    half = tl.arange(0, BLOCK_HALF)[None, :]
    half_ok = half < HALF
    first = head * HEAD_DIM  # q heads, then k heads, in the qkv row
    x1 = _head_values(
        sums_ptr, elements, token, n, first + half, half_ok, rstd, bias_ptr,
        SLOTS, GROUP, NORM, HAS_BIAS, x_dtype, EMULATE_BF16,
    )  # fmt: skip
    x2 = _head_values(
        sums_ptr, elements, token, n, first + HALF + half, half_ok, rstd, bias_ptr,
        SLOTS, GROUP, NORM, HAS_BIAS, x_dtype, EMULATE_BF16,
    )  # fmt: skip
    out1, out2 = rotate_halves(x1, x2, cos, sin, x_dtype, EMULATE_BF16)
    if head < n_q_heads:
        out = q_out_ptr + token * n_q_heads * HEAD_DIM + head * HEAD_DIM
    else:
        slot = tl.load(slots_ptr + token).to(tl.int64)
        kv_head = head - n_q_heads
        out = k_cache_ptr + slot * cache_row_stride + kv_head * HEAD_DIM
        # The v head of the same index: its values straight into its slot.
        dims = tl.arange(0, BLOCK_D)[None, :]
        dims_ok = dims < HEAD_DIM
        v_first = (n_q_heads + n_kv_heads + kv_head) * HEAD_DIM
        v = _head_values(
            sums_ptr, elements, token, n, v_first + dims, dims_ok, rstd, bias_ptr,
            SLOTS, GROUP, NORM, HAS_BIAS, x_dtype, EMULATE_BF16,
        )  # fmt: skip
        v_out = v_cache_ptr + slot * cache_row_stride + kv_head * HEAD_DIM
        tl.store(v_out + dims, v.to(x_dtype), mask=dims_ok)
    tl.store(out + half, out1, mask=half_ok)
    tl.store(out + HALF + half, out2, mask=half_ok)
    if PASS > 0:
        rest = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
        rest_ok = rest < HEAD_DIM
        kept = _head_values(
            sums_ptr, elements, token, n, first + rest, rest_ok, rstd, bias_ptr,
            SLOTS, GROUP, NORM, HAS_BIAS, x_dtype, EMULATE_BF16,
        )  # fmt: skip
        tl.store(out + rest, kept.to(x_dtype), mask=rest_ok)


# Triton 3.6's interpreter truncates float32 -> bfloat16 (kernels.backend.cast_rtne).
_INTERPRETED = is_interpreted(_slot_sum_rope_kernel)


def _check_rope(rope: RopeCacheWrite, q_out: torch.Tensor) -> None:
    T, D = q_out.shape[0], rope.head_dim
    if q_out.shape != (T, rope.num_heads, D) or not q_out.is_contiguous():
        raise ValueError(
            f"q_out must be a contiguous [T, {rope.num_heads}, {D}], got {tuple(q_out.shape)}"
        )
    for name, t in (("positions", rope.positions), ("slots", rope.slots)):
        if t.shape != (T,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 [T={T}], got {t.dtype} {tuple(t.shape)}")
    half = rope.cos.shape[-1]
    if rope.cos.dim() != 2 or rope.sin.shape != rope.cos.shape or not 0 < 2 * half <= D:
        raise ValueError(
            f"cos and sin must be [max_pos, R/2] with R <= head_dim {D}, got "
            f"{tuple(rope.cos.shape)} and {tuple(rope.sin.shape)}"
        )
    for name, cache in (("k_cache", rope.k_cache), ("v_cache", rope.v_cache)):
        if (
            cache.dim() not in (3, 4)
            or cache.shape[-2:] != (rope.num_kv_heads, D)
            or cache.dtype != q_out.dtype
            or not cache.is_contiguous()
        ):
            raise ValueError(
                f"{name} must be a contiguous native cache [..., {rope.num_kv_heads}, {D}] of "
                f"{q_out.dtype}, got {cache.dtype} {tuple(cache.shape)}"
            )


def launch_slot_sum_rope(
    sums: torch.Tensor,
    slots: int,
    rope: RopeCacheWrite,
    q_out: torch.Tensor,
    *,
    norm: SlotNorm | None = None,
    bias: torch.Tensor | None = None,
    pdl: bool | None = None,
) -> None:
    """q_out [T, Hq, D] = the rotated q of the qkv sums, k and v written into their cache
    slots (module docstring): the sum over slots 0..slots-1 of the workspace's [T, n]
    partials (n = rope.width), in slot order, times the row's rstd with `norm`, plus `bias`
    ([n]), rounded to q_out's dtype, then RoPE. `pdl` as for slot_sum.launch_slot_sum."""
    _check_rope(rope, q_out)
    T, n = q_out.shape[0], rope.width
    if sums.dtype != torch.float32 or sums.numel() < slots * T * n:
        raise ValueError(
            f"sums must be float32 with at least {slots} x {T * n} elements, got "
            f"{sums.dtype} x {sums.numel()}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if norm is not None:
        check_slot_norm(T, norm)
    if T == 0:
        return
    use_pdl = programmatic_launch(q_out) if pdl is None else pdl and programmatic_launch(q_out)
    D, half = rope.head_dim, rope.cos.shape[-1]
    k_flat = rope.k_cache.view(-1, rope.num_kv_heads, D)
    v_flat = rope.v_cache.view(-1, rope.num_kv_heads, D)
    squares = norm.squares if norm is not None else None
    cos, sin = rope.cos.contiguous(), rope.sin.contiguous()
    _slot_sum_rope_kernel[(T, rope.num_heads + rope.num_kv_heads)](
        sums,
        q_out,
        k_flat,
        v_flat,
        rope.positions.contiguous(),
        rope.slots.contiguous(),
        cos,
        sin,
        bias.contiguous() if bias is not None else sums,  # a dummy pointer when absent
        squares.sums if squares is not None else sums,
        squares.chunks if squares is not None else 1,
        norm.d if norm is not None else 1,
        float(norm.eps) if norm is not None else 0.0,
        n,
        T * n,
        cos.stride(0),
        sin.stride(0),
        k_flat.stride(0),
        cos.shape[0],
        rope.num_heads,
        rope.num_kv_heads,
        SLOTS=slots,
        GROUP=max(slots, 1),
        HALF=half,
        PASS=D - 2 * half,
        HEAD_DIM=D,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(max(D - 2 * half, 1)),
        BLOCK_D=triton.next_power_of_2(D),
        NORM=norm is not None,
        HAS_BIAS=bias is not None,
        CHUNKS_POW2=triton.next_power_of_2(squares.chunks) if squares is not None else 1,
        USE_PDL=use_pdl,
        EMULATE_BF16=_INTERPRETED,
        num_warps=2,
        # The slot sum's and the rotation's roundings, never contracted into FMAs.
        enable_fp_fusion=False,
        launch_pdl=use_pdl,
    )
