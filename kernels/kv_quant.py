"""Quantized KV-cache storage: formats, the write (quantize + scatter) op and its reference.

A cache type names one storage format for K and one for V:

    cache type   K        V        bytes per element (K and V averaged, head_dim 128)
    fp16         native   native   2 (the model's dtype: float16, bfloat16 or float32)
    fp8          fp8      fp8      1.016
    q8           int8     int8     1.0625
    q6           int6     int6     0.8125
    q4           int4     int4     0.5625

(exllamav2's Q6 stores 8-bit K and 4-bit V, the same bytes as 6/6; on SmolLM2-135M 6/6
cost half as much perplexity, so q6 is 6-bit codes for both. K and V may still have
different formats: the kernels take one each.)

Packed layout. A native cache is [pages, page_size, kv_heads, head_dim] in the model's
dtype. Every other format stores one byte row per (token, kv head):
[pages, page_size, kv_heads, row_bytes] uint8, the codes first and then the row's float16
scales (little-endian, 2-byte aligned), so a page holds everything its tokens need and page
sharing, prefix caching and copy-on-write stay byte copies of whole pages:

    fp8    head_dim bytes of float8 e4m3fn codes, then 1 scale: value = e4m3(code) * scale;
           the scale is max|x| / 448 over the (token, head) row, so the row uses e4m3's whole
           range (small heads keep their 3 mantissa bits instead of falling into subnormals).
    int8   head_dim bytes, code c in 0..255, then head_dim / G scales: value = (c - 128) * s.
    int4   head_dim / 2 bytes, dims 2i (low nibble) and 2i+1 (high nibble) in byte i, then
           head_dim / G scales: value = (c - 8) * s.
    int6   two planes: the low 4 bits of every code as int4 packs them (head_dim / 2
           bytes), then the high 2 bits, dims 4j..4j+3 in byte j from bit 0 up (head_dim / 4
           bytes), then head_dim / G scales: value = (c - 32) * s.

Groups (int8/int6/int4): G = 32 consecutive dims (16 when head_dim is not a multiple of
32) share one float16 scale s = m / -2^(bits-1), m the group's element of largest magnitude
(so m itself is exact, as llama.cpp's q4_0 does); codes are round-to-nearest-even, clamped.
exllamav2's Q4/Q6/Q8 cache also keeps one float16 scale per 32 values.

Rotation (int8/int6/int4): before quantizing, each group of G dims is multiplied by the
orthonormal G x G Hadamard matrix H (symmetric, H @ H = I). That spreads a channel outlier
over its group, so the shared scale no longer crushes the other 31 values (exllamav3's
quantized cache does the same: a 32-wide Hadamard transform, then per-32 quantization).
Attention never undoes it per key: since (qH).(kH) = q.k, the query is rotated once
instead, and for V the output is rotated back once per query row (P (vH) = (P v) H).
`kernels.paged_attention` (kernels/attention/) does both.

Why these choices (perplexity of SmolLM2-135M-Instruct, 8 x 512 tokens of wiki.utf8,
float32; fp16 cache 23.703): q4 as built 24.445; without rotation 25.547; rotating K only
24.522; a 64-wide rotation with 32-dim groups 24.651; 16-dim groups 24.609; asymmetric
min/max codes 24.497. q6 as 6/6 bits 23.750, as exllamav2's 8-bit K / 4-bit V 23.810
(23.898 unrotated). fp8 with the per-row scale 23.724, as a plain cast 23.915.

`kv_cache_write` quantizes new K or V rows [T, Hk, D] into the cache at flat slots (a Triton
kernel on CUDA, `kv_cache_write_reference` otherwise); `dequantize_rows` is the torch
inverse that the reference attention and the tests use.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.backend import Backend, device_guard, resolve_backend

FP8_MAX = 448.0  # largest finite float8 e4m3fn


@dataclass(frozen=True)
class KVFormat:
    """How one of K or V is stored. kind: "native", "fp8", "int8", "int6" or "int4"."""

    kind: str

    @property
    def quantized(self) -> bool:
        return self.kind != "native"

    @property
    def bits(self) -> int:
        return {"fp8": 8, "int8": 8, "int6": 6, "int4": 4}[self.kind]

    @property
    def rotated(self) -> bool:
        return self.kind in ("int8", "int6", "int4")

    def group_size(self, head_dim: int) -> int:
        """Dims per scale (the whole row for fp8)."""
        if self.kind == "fp8":
            return head_dim
        for g in (32, 16):
            if head_dim % g == 0:
                return g
        raise ValueError(
            f"an {self.kind} KV cache needs head_dim to be a multiple of 16, got {head_dim}"
        )

    def code_bytes(self, head_dim: int) -> int:
        return head_dim * self.bits // 8

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one (token, kv head) row: codes, then float16 scales, padded to a
        multiple of 16. The padding makes every row start 16-byte aligned (Triton proves
        that from the strides), so attention loads a row's codes 16 bytes at a time; with
        136-byte int8 rows it could only load single bytes, which made the quantized
        decode kernel ~5x slower than the float16 one on an H200."""
        return -(-self.data_bytes(head_dim) // 16) * 16

    def data_bytes(self, head_dim: int) -> int:
        """The bytes of a row that hold data (codes and scales); the rest is padding."""
        return self.code_bytes(head_dim) + 2 * (head_dim // self.group_size(head_dim))

    def bytes_per_head_row(self, head_dim: int, dtype: torch.dtype) -> int:
        if not self.quantized:
            return head_dim * dtype.itemsize
        return self.row_bytes(head_dim)


NATIVE = KVFormat("native")
CACHE_TYPES: dict[str, tuple[KVFormat, KVFormat]] = {
    "fp16": (NATIVE, NATIVE),
    "fp8": (KVFormat("fp8"), KVFormat("fp8")),
    "q8": (KVFormat("int8"), KVFormat("int8")),
    "q6": (KVFormat("int6"), KVFormat("int6")),
    "q4": (KVFormat("int4"), KVFormat("int4")),
}
# The kernels' constexpr for a format.
KIND_CODES = {"native": 0, "fp8": 1, "int8": 2, "int4": 3, "int6": 4}


def cache_formats(cache_type: str) -> tuple[KVFormat, KVFormat]:
    """(K format, V format) of a cache type; ValueError naming the known ones otherwise."""
    if cache_type not in CACHE_TYPES:
        raise ValueError(f"unknown cache_type {cache_type!r} (available: {', '.join(CACHE_TYPES)})")
    return CACHE_TYPES[cache_type]


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(size: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(size)


_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}
_HADAMARD_NATIVE: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def hadamard(size: int, device: torch.device) -> torch.Tensor:
    """Orthonormal, symmetric Sylvester Hadamard matrix [size, size] float32 (cached)."""
    key = (size, device)
    if key not in _HADAMARD:
        _HADAMARD[key] = _hadamard_cpu(size).to(device)
    return _HADAMARD[key]


def rotate(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., D] with each run of `group` dims multiplied by H (its own inverse); float32."""
    shape = x.shape
    h = hadamard(group, x.device)
    return (x.float().reshape(-1, group) @ h).reshape(shape)


def rotate_native(x: torch.Tensor, group: int) -> torch.Tensor:
    """`rotate` in x's dtype: one tensor-core matmul with H in that dtype, accumulated in
    float32. The float32 version costs a cast, an FMA-unit GEMM and a cast back, four times
    per layer and step (q, k, v, output): on an H200 that was ~0.8 ms of an 8B model's 3 ms
    decode step. Used for q and the attention output, which are rounded to their dtype
    anyway; the cache write keeps float32 so that codes come from unrounded values. Every
    entry of H is +-1/sqrt(group), so rounding H to float16 scales the result by one
    constant (1 - 1.1e-4 for group 32), far below the cache's own error."""
    if x.dtype == torch.float32 or x.device.type == "cpu":
        return rotate(x, group).to(x.dtype)
    key = (group, x.device, x.dtype)
    h = _HADAMARD_NATIVE.get(key)
    if h is None:
        h = _HADAMARD_NATIVE[key] = hadamard(group, x.device).to(x.dtype)
    return (x.reshape(-1, group) @ h).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# Torch reference.


def _fp8_codes(y: torch.Tensor) -> torch.Tensor:
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def quantize_rows(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """x [N, D] (any float dtype, already rotated where the format rotates) -> [N, row_bytes]."""
    n, d = x.shape
    g = fmt.group_size(d)
    xg = x.float().reshape(n, d // g, g)
    if fmt.kind == "fp8":
        scale = (xg.abs().amax(-1) / FP8_MAX).half()  # [N, 1]
        s = scale.float()
        inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
        codes = _fp8_codes(xg * inv[..., None]).reshape(n, d)
    else:
        half_range = 1 << (fmt.bits - 1)
        idx = xg.abs().argmax(-1, keepdim=True)
        m = xg.gather(-1, idx).squeeze(-1)  # signed element of largest magnitude
        scale = (m / -half_range).half()
        s = scale.float()[..., None]
        safe = torch.where(s != 0, s, torch.ones_like(s))
        q = torch.round(xg / safe).clamp(-half_range, half_range - 1)
        q = torch.where(s != 0, q, torch.zeros_like(q))
        codes = (q + half_range).to(torch.uint8).reshape(n, d)
        if fmt.kind in ("int4", "int6"):
            low = codes & 15
            packed = low[:, 0::2] | (low[:, 1::2] << 4)
            if fmt.kind == "int6":
                high = codes >> 4
                pairs = high[:, 0::4] | high[:, 1::4] << 2 | high[:, 2::4] << 4 | high[:, 3::4] << 6
                packed = torch.cat([packed, pairs], dim=1)
            codes = packed
    rows = torch.cat([codes, scale.reshape(n, -1).contiguous().view(torch.uint8)], dim=1)
    pad = fmt.row_bytes(d) - rows.shape[1]
    return torch.nn.functional.pad(rows, (0, pad)) if pad else rows


def dequantize_rows(rows: torch.Tensor, fmt: KVFormat, head_dim: int) -> torch.Tensor:
    """[N, row_bytes] uint8 -> [N, D] float32, still rotated where the format rotates."""
    n = rows.shape[0]
    d, g = head_dim, fmt.group_size(head_dim)
    cb = fmt.code_bytes(d)
    codes = rows[:, :cb]
    scales = rows[:, cb : cb + 2 * (d // g)].contiguous().view(torch.float16).float()  # [N, D/G]
    if fmt.kind == "fp8":
        values = codes.contiguous().view(torch.float8_e4m3fn).float()
    else:
        if fmt.kind in ("int4", "int6"):
            low = codes[:, : d // 2]
            low = torch.stack([low & 15, low >> 4], dim=-1).reshape(n, d)
            if fmt.kind == "int6":
                high = codes[:, d // 2 :]
                high = torch.stack([(high >> (2 * i)) & 3 for i in range(4)], dim=-1)
                low = low | (high.reshape(n, d) << 4)
            codes = low
        values = codes.float() - (1 << (fmt.bits - 1))
    return (values.reshape(n, d // g, g) * scales[..., None]).reshape(n, d)


def kv_cache_write_reference(
    x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, fmt: KVFormat
) -> None:
    """Store x [T, Hk, D] at flat slots [T] of `cache` ([P, S, Hk, row] or native)."""
    if not fmt.quantized:
        flat = cache.view(-1, *cache.shape[-2:])
        flat.index_copy_(0, slots, x.to(cache.dtype))
        return
    t, hk, d = x.shape
    if fmt.rotated:
        x = rotate(x, fmt.group_size(d))
    rows = quantize_rows(x.reshape(t * hk, d), fmt).view(t, hk, -1)
    cache.view(-1, hk, cache.shape[-1]).index_copy_(0, slots, rows)


# ---------------------------------------------------------------------------------------------
# Triton: one program per (token, kv head) quantizes its row and stores it in place.


@triton.jit
def _rtne(x):
    # Round to nearest even in float32 for |x| < 2^22: the add rounds away the fraction.
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _encode_e4m3(y):
    """float32 y (|y| <= 448) -> float8 e4m3fn bit patterns (int32), rounding to nearest even."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    exp = (bits >> 23) - 127
    # Quantum of a's binade: 3 mantissa bits; below 2^-6 (subnormals) it stays 2^-9.
    q_exp = tl.maximum(exp, -6) - 3
    quantum = ((q_exp + 127) << 23).to(tl.float32, bitcast=True)
    k = _rtne(a / quantum)  # exact division by a power of two; k in 0..16
    r = k * quantum
    r_bits = r.to(tl.int32, bitcast=True)
    normal = ((((r_bits >> 23) - 127 + 7) << 3) | ((r_bits >> 20) & 7)).to(tl.int32)
    code = tl.where(r >= 0.015625, normal, k.to(tl.int32))
    sign = tl.where(y < 0, 128, 0)
    return code | sign


@triton.jit
def _int_codes(x, s, HALF: tl.constexpr):
    safe = tl.where(s != 0.0, s, 1.0)
    q = tl.minimum(tl.maximum(_rtne(x / safe), -HALF), HALF - 1)
    q = tl.where(s != 0.0, q, 0.0)
    return (q + HALF).to(tl.int32)


@triton.jit
def _kv_write_kernel(
    x_ptr,  # [T, Hk, D] new rows (rotated already where the format rotates)
    slots_ptr,
    cache_ptr,  # uint8 [P*S, Hk, ROW_BYTES] viewed flat
    stride_x_tok,
    stride_x_head,
    stride_c_slot,
    stride_c_head,
    KIND: tl.constexpr,  # 1 fp8, 2 int8, 3 int4, 4 int6
    GROUPS: tl.constexpr,  # scales per row
    BLOCK_GROUPS: tl.constexpr,  # GROUPS padded to a power of two
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP_SIZE padded to a power of two (fp8's group is the row)
    CODE_BYTES: tl.constexpr,
    HIGH_PLANE: tl.constexpr,  # int6: byte offset of the high bit pairs (head_dim / 2)
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    x_row = x_ptr + tok.to(tl.int64) * stride_x_tok + head * stride_x_head
    row = cache_ptr + slot * stride_c_slot + head * stride_c_head
    scale_ptr = (row + CODE_BYTES).to(tl.pointer_type(tl.float16))
    grp = tl.arange(0, BLOCK_GROUPS)
    grp_mask = grp < GROUPS
    if KIND == 4:
        # Quads (4j..4j+3): two bytes of low nibbles and one byte of high bit pairs.
        quad = tl.arange(0, GROUP_SIZE // 4)
        dim0 = grp[:, None] * GROUP_SIZE + 4 * quad[None, :]
        quad_mask = grp_mask[:, None]
        x0 = tl.load(x_row + dim0, mask=quad_mask, other=0.0).to(tl.float32)
        x1 = tl.load(x_row + dim0 + 1, mask=quad_mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + dim0 + 2, mask=quad_mask, other=0.0).to(tl.float32)
        x3 = tl.load(x_row + dim0 + 3, mask=quad_mask, other=0.0).to(tl.float32)
        mx = tl.max(tl.maximum(tl.maximum(x0, x1), tl.maximum(x2, x3)), axis=1)
        mn = tl.min(tl.minimum(tl.minimum(x0, x1), tl.minimum(x2, x3)), axis=1)
        m = tl.where(mx >= -mn, mx, mn)
        s = (m / -32.0).to(tl.float16)
        sf = s.to(tl.float32)[:, None]
        c0 = _int_codes(x0, sf, 32)
        c1 = _int_codes(x1, sf, 32)
        c2 = _int_codes(x2, sf, 32)
        c3 = _int_codes(x3, sf, 32)
        tl.store(row + dim0 // 2, ((c0 & 15) | ((c1 & 15) << 4)).to(tl.uint8), mask=quad_mask)
        tl.store(row + dim0 // 2 + 1, ((c2 & 15) | ((c3 & 15) << 4)).to(tl.uint8), mask=quad_mask)
        high = (c0 >> 4) | ((c1 >> 4) << 2) | ((c2 >> 4) << 4) | ((c3 >> 4) << 6)
        tl.store(row + HIGH_PLANE + dim0 // 4, high.to(tl.uint8), mask=quad_mask)
        tl.store(scale_ptr + grp, s, mask=grp_mask)
    elif KIND == 3:
        # Pairs (2i, 2i+1) share a byte: load the even and odd dims as two tiles.
        half_i = tl.arange(0, GROUP_SIZE // 2)
        dim_even = grp[:, None] * GROUP_SIZE + 2 * half_i[None, :]
        pair_mask = grp_mask[:, None]
        even = tl.load(x_row + dim_even, mask=pair_mask, other=0.0).to(tl.float32)
        odd = tl.load(x_row + dim_even + 1, mask=pair_mask, other=0.0).to(tl.float32)
        mx = tl.maximum(tl.max(even, axis=1), tl.max(odd, axis=1))
        mn = tl.minimum(tl.min(even, axis=1), tl.min(odd, axis=1))
        m = tl.where(mx >= -mn, mx, mn)
        s = (m / -8.0).to(tl.float16)
        sf = s.to(tl.float32)[:, None]
        packed = _int_codes(even, sf, 8) | (_int_codes(odd, sf, 8) << 4)
        tl.store(row + dim_even // 2, packed.to(tl.uint8), mask=pair_mask)
        tl.store(scale_ptr + grp, s, mask=grp_mask)
    else:
        inner = tl.arange(0, BLOCK_G)
        dims = grp[:, None] * GROUP_SIZE + inner[None, :]
        mask = grp_mask[:, None] & (inner < GROUP_SIZE)[None, :]
        x = tl.load(x_row + dims, mask=mask, other=0.0).to(tl.float32)  # [GROUPS, BLOCK_G]
        if KIND == 1:
            s = (tl.max(tl.abs(x), axis=1) / 448.0).to(tl.float16)
            sf = s.to(tl.float32)[:, None]
            inv = tl.where(sf > 0.0, 1.0 / tl.where(sf > 0.0, sf, 1.0), 0.0)
            y = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
            codes = _encode_e4m3(y)
        else:
            mx = tl.max(x, axis=1)
            mn = tl.min(x, axis=1)
            m = tl.where(mx >= -mn, mx, mn)
            s = (m / -128.0).to(tl.float16)
            codes = _int_codes(x, s.to(tl.float32)[:, None], 128)
        tl.store(row + dims, codes.to(tl.uint8), mask=mask)
        tl.store(scale_ptr + grp, s, mask=grp_mask)


def kv_cache_write_triton(
    x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, fmt: KVFormat
) -> None:
    if not fmt.quantized:
        kv_cache_write_reference(x, cache, slots, fmt)
        return
    t, hk, d = x.shape
    if t == 0:
        return
    g = fmt.group_size(d)
    if fmt.rotated:
        # float32: the codes are those of the reference (quantized from unrounded values).
        x = rotate(x, g).view(t, hk, d)
    if x.stride(-1) != 1:
        x = x.contiguous()
    flat = cache.view(-1, hk, cache.shape[-1])
    with device_guard(x):
        _kv_write_kernel[(t, hk)](
            x,
            slots,
            flat,
            x.stride(0),
            x.stride(1),
            flat.stride(0),
            flat.stride(1),
            KIND=KIND_CODES[fmt.kind],
            GROUPS=d // g,
            BLOCK_GROUPS=triton.next_power_of_2(d // g),
            GROUP_SIZE=g,
            BLOCK_G=triton.next_power_of_2(g),
            CODE_BYTES=fmt.code_bytes(d),
            HIGH_PLANE=d // 2,
            num_warps=1,
        )


def check_cache_tensor(
    cache: torch.Tensor, fmt: KVFormat, head_dim: int, name: str, *, flat: bool = False
) -> None:
    """A quantized cache plane as the kernels read it: pages [P, S, Hk, row], or with
    `flat` (writers) also the flat slots [P * S + scratch, Hk, row] (engine.cache)."""
    if not fmt.quantized:
        return
    want = fmt.row_bytes(head_dim)
    dims = (3, 4) if flat else (4,)
    if cache.dtype != torch.uint8 or cache.dim() not in dims or cache.shape[-1] != want:
        raise ValueError(
            f"{name} must be uint8 [P, S, Hk, {want}]{' or [slots, Hk, row]' if flat else ''} "
            f"for {fmt.kind} storage of head_dim {head_dim}, got {cache.dtype} "
            f"{tuple(cache.shape)}"
        )
    if cache.stride(-1) != 1 or cache.stride(-2) % 2 or cache.stride(-3) % 2:
        raise ValueError(f"{name} rows must be dense and 2-byte aligned (float16 scales)")


def kv_cache_write(
    x: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    fmt: KVFormat,
    *,
    backend: Backend = "auto",
) -> None:
    """Quantize x [T, Hk, D] into `cache` ([P, S, Hk, row] pages or [slots, Hk, row]) at
    flat slots [T]; Triton on CUDA."""
    if x.dim() != 3 or slots.shape != (x.shape[0],):
        raise ValueError(
            f"expected x [T, Hk, D] and slots [T], got {tuple(x.shape)} and {tuple(slots.shape)}"
        )
    check_cache_tensor(cache, fmt, x.shape[-1], "cache", flat=True)
    if resolve_backend(backend, x, cache, slots) == "triton":
        kv_cache_write_triton(x, cache, slots, fmt)
    else:
        kv_cache_write_reference(x, cache, slots, fmt)
