"""Writing EXL2 tensors: the packer and a round-to-nearest quantizer with the converter's scales.

pack_exl2(codes [k, n] stored order, group_bits, group_sizes, scale_codes [G, n],
          scale_max [G], invperm [k], bias [n] | None) -> {name: tensor}
    the tensors exllamav2's converter writes for one linear (names without the module
    prefix): q_invperm int32 [k], q_scale_max fp16 [G], q_groups int16 [2G], bias fp16
    [w] (if any), q_scale int32 [G, w/8], q_weight int32 [.., w], with w = n rounded up to
    32. Like the converter (conversion/adaptivegptq.py, AdaptiveGPTQ.pack) it writes no
    q_perm. Padded columns get the zero-point code and scale code 15 (the converter's
    pack_rows_4 turns its zero padding into nibble 0xF); the bias is padded with zeros so
    that exllamav2's make_q_matrix, which wants bias [w], accepts it.

quantize_rtn_exl2(weight [n, k] HF layout, bits, group_size, perm) -> the same dict, with
    each group's scales fitted as AdaptiveQuantizer.find_params does and codes rounded to
    nearest (no GPTQ error feedback). The quantizer replaces the codes with GPTQ ones later.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.quant.bitpack import pack_along_columns, pack_bitstream
from engine.quant.exl2 import (
    EXL2_BITS,
    EXL2_MAX_IN_FEATURES,
    exl2_group_rows_multiple,
    exl2_scales,
)

# The converter's scale search (AdaptiveQuantizer): p in [0.70, 1.20] on 97 points, each
# scored by sum |error|^3.5 over the group.
_ERR_NORM = 3.5
_MIN_P, _MAX_P, _P_GRID = 0.70, 1.20, 96
# Elements per chunk of the p search (p values x rows x columns), to bound memory.
_CHUNK_ELEMENTS = 1 << 22


def pack_exl2(
    codes: torch.Tensor,
    group_bits: Sequence[int],
    group_sizes: Sequence[int],
    scale_codes: torch.Tensor,
    scale_max: torch.Tensor,
    invperm: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Pack quantized codes into EXL2 tensors (see the module docstring)."""
    k, n = codes.shape
    g = len(group_bits)
    if len(group_sizes) != g or g == 0:
        raise ValueError(f"{g} group bits but {len(group_sizes)} group sizes")
    if sum(group_sizes) != k:
        raise ValueError(f"group sizes sum to {sum(group_sizes)}, codes have {k} rows")
    if k > EXL2_MAX_IN_FEATURES:
        raise ValueError(f"EXL2 allows at most {EXL2_MAX_IN_FEATURES} input features, got {k}")
    for i, (b, size) in enumerate(zip(group_bits, group_sizes, strict=True)):
        if b not in EXL2_BITS:
            raise ValueError(f"group {i}: bits must be one of {EXL2_BITS}, got {b}")
        if i and b > group_bits[i - 1]:
            raise ValueError(f"group bits must be non-increasing, got {group_bits[i - 1]} then {b}")
        step = exl2_group_rows_multiple(b)
        if size <= 0 or (i < g - 1 and size % step):
            raise ValueError(
                f"group {i}: {size} rows; groups but the last need multiples of {step}"
            )
    if tuple(scale_codes.shape) != (g, n):
        raise ValueError(f"scale_codes must be [{g}, {n}], got {list(scale_codes.shape)}")
    if int(scale_codes.min()) < 0 or int(scale_codes.max()) > 15:
        raise ValueError("scale codes must lie in 0..15")
    if tuple(scale_max.shape) != (g,):
        raise ValueError(f"scale_max must be [{g}], got {list(scale_max.shape)}")
    if tuple(invperm.shape) != (k,) or not bool(
        (torch.sort(invperm.long()).values == torch.arange(k, device=invperm.device)).all()
    ):
        raise ValueError(f"invperm must be a permutation of 0..{k - 1}")

    pad = -n % 32
    q_weight = []
    q_groups = []
    row = out_row = 0
    for b, size in zip(group_bits, group_sizes, strict=True):
        block = codes[row : row + size]
        if pad:
            block = F.pad(block.to(torch.int32), (0, pad), value=2 ** (b - 1))
        packed = pack_bitstream(block, b)
        q_groups += [b, out_row]
        q_weight.append(packed)
        row += size
        out_row += packed.shape[0]

    out: dict[str, torch.Tensor] = {
        "q_invperm": invperm.to(torch.int32).contiguous(),
        "q_scale_max": scale_max.to(torch.float16).contiguous(),
        "q_groups": torch.tensor(q_groups, dtype=torch.int16, device=codes.device),
    }
    if bias is not None:
        out["bias"] = F.pad(bias.to(torch.float16), (0, pad)).contiguous()
    out["q_scale"] = pack_along_columns(F.pad(scale_codes.to(torch.int32), (0, pad), value=15), 4)
    out["q_weight"] = torch.cat(q_weight, dim=0)
    return out


def fit_exl2_scales(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The converter's scale fit for one group x [rows, n] (fp32, stored order).

    Returns (scale codes int32 [n] in 0..15, scale_max fp16 [], scale fp16 [n]); the scale
    is the one the dequantizer will compute from the first two.
    """
    maxq = 2**bits - 1
    qzero = 2 ** (bits - 1)
    base = (x.abs().amax(dim=0) + 1e-12) / (maxq / 2)
    smax = base.max()
    qscale = torch.clamp(torch.round(torch.sqrt(base / smax) * 16), 1, 16)
    trial = (qscale / 16) ** 2 * smax  # [n]

    steps = torch.arange(_P_GRID + 1, device=x.device, dtype=torch.float32) / _P_GRID
    ps = _MIN_P * (1 - steps) + _MAX_P * steps
    err = torch.empty(_P_GRID + 1, device=x.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, x.numel()))
    for i in range(0, _P_GRID + 1, chunk):
        s = trial[None, None, :] * ps[i : i + chunk, None, None]  # [p, 1, n]
        q = torch.clamp(torch.round(x[None] / s), -qzero, maxq - qzero)
        err[i : i + chunk] = (q * s - x[None]).abs().pow(_ERR_NORM).sum(dim=(1, 2))
    best = torch.argmin(err).float() / _P_GRID
    best_p = _MAX_P * best + _MIN_P * (1 - best)

    scale_codes = qscale.to(torch.int32) - 1
    scale_max = (smax * best_p).to(torch.float16)
    # exl2_scales takes packed codes; one row of 8-aligned width is cheap to pack here.
    width = -(-x.shape[1] // 8) * 8
    packed = pack_along_columns(F.pad(scale_codes, (0, width - x.shape[1]))[None], 4)
    scale = exl2_scales(packed, scale_max[None], width)[0, : x.shape[1]]
    return scale_codes, scale_max, scale


def quantize_group_rtn(x: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Round-to-nearest codes [rows, n] of x with per-column fp16 scales (int32, unsigned)."""
    maxq, qzero = 2**bits - 1, 2 ** (bits - 1)
    s = scale.float()
    q = torch.round(x / torch.where(s == 0, torch.ones_like(s), s)) + qzero
    q = torch.where(s == 0, torch.full_like(q, qzero), q)  # an all-zero column
    return torch.clamp(q, 0, maxq).to(torch.int32)


def _group_sizes(k: int, group_size: int | Sequence[int]) -> list[int]:
    if isinstance(group_size, int):
        if group_size <= 0:
            raise ValueError(f"group_size must be positive, got {group_size}")
        return [group_size] * (k // group_size) + ([k % group_size] if k % group_size else [])
    return list(group_size)


def quantize_rtn_exl2(
    weight: torch.Tensor,
    bits: int | Sequence[int],
    group_size: int | Sequence[int] = 128,
    *,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Round-to-nearest EXL2 quantization of an HF weight [n, k] (see the module docstring).

    bits: one width for every group, or one per group (non-increasing). group_size: rows per
    group (the last may be short) or a list of sizes. perm: stored row i holds input row
    perm[i] (the converter's act-order permutation); None keeps the input order.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out_features, in_features], got {list(weight.shape)}")
    w = weight.float().t().contiguous()  # [k, n]
    k = w.shape[0]
    sizes = _group_sizes(k, group_size)
    group_bits = [bits] * len(sizes) if isinstance(bits, int) else list(bits)
    if len(group_bits) != len(sizes):
        raise ValueError(f"{len(group_bits)} group bits for {len(sizes)} groups")
    if perm is None:
        perm = torch.arange(k, device=w.device)
    w = w[perm.long()]
    invperm = torch.argsort(perm.long())

    codes, scale_codes, scale_max = [], [], []
    row = 0
    for b, size in zip(group_bits, sizes, strict=True):
        x = w[row : row + size]
        sc, smax, scale = fit_exl2_scales(x, b)
        codes.append(quantize_group_rtn(x, scale, b))
        scale_codes.append(sc)
        scale_max.append(smax)
        row += size
    return pack_exl2(
        torch.cat(codes),
        group_bits,
        sizes,
        torch.stack(scale_codes),
        torch.stack(scale_max),
        invperm,
        bias,
    )
