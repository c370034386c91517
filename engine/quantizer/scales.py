"""The EXL2 scale fit of one group: per-column 4-bit scale codes and one fp16 maximum.

    scale_codes, scale_max, scale = fit_scales(x [rows, n], bits, search="fast")

A group's scales follow the converter's rule (engine.quant.exl2_writer.fit_exl2_scales):
per-column codes from the column maxima, then one factor p on 97 points in [0.70, 1.20]
for the group's maximum, the one with the least Σ|q·s − x|^3.5. "full" scores all 97
points; "fast" every 8th, then the neighbours of the best; "coarse" every 16th (7 points,
for the measurement). `dequant_scales` gives the fp16 scales the dequantizer computes from
the codes.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.quant.exl2_writer import fit_exl2_scales

# The converter's scale search: factors p on 97 points in [0.70, 1.20], score Σ|err|^3.5.
_P_GRID = torch.linspace(0, 1, 97, dtype=torch.float64)
_P_VALUES = (0.70 * (1 - _P_GRID) + 1.20 * _P_GRID).tolist()
_ERR_NORM = 3.5
SCALE_SEARCHES = ("full", "fast", "coarse")
# fp32 values per column block of the CPU grid search (three buffers of 256 KB).
_GRID_ELEMENTS = 1 << 16


def fit_scales(
    x: torch.Tensor, bits: int, search: str = "full"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale codes int32 [n], scale_max fp16 [], scale fp16 [n]) of one group x [rows, n].

    "full" is fit_exl2_scales (all 97 factors). "fast" scores every 8th factor, then the
    neighbours of the best; "coarse" only every 16th (7 points, for the measurement).
    Both follow the same rule on fewer points, in cache-sized column blocks, which is what
    makes CPU conversion practical; "fast" picks the same factor as "full" on almost every
    group.
    """
    if search == "full":
        return fit_exl2_scales(x, bits)
    if search not in SCALE_SEARCHES:
        raise ValueError(f"scale search must be one of {SCALE_SEARCHES}, got {search!r}")
    points = list(range(0, 97, 8 if search == "fast" else 16))
    search_p = _search_numpy if x.device.type == "cpu" else _search_torch
    qscale, smax, best = search_p(x, bits, points, refine=search == "fast")
    scale_codes = qscale.to(torch.int32) - 1
    scale_max = (smax * _P_VALUES[best]).to(torch.float16)
    return scale_codes, scale_max, dequant_scales(scale_codes, scale_max)


# Both searches: per-column codes from the column maxima (qscale, 1..16), trial scales
# (qscale/16)²·smax, then Σ|q·s·p − x|^3.5 = Σ_c trial_c^3.5 · Σ_r |round(r/p)·p − r|^3.5
# with r = x / trial, over the points; "fast" then scores the 15 points around the best.


def _search_torch(
    x: torch.Tensor, bits: int, points: list[int], *, refine: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    maxq, qzero = 2**bits - 1, 2 ** (bits - 1)
    base = (x.abs().amax(dim=0) + 1e-12) / (maxq / 2)
    smax = base.max()
    qscale = torch.clamp(torch.round(torch.sqrt(base / smax) * 16), 1, 16)
    trial = (qscale / 16) ** 2 * smax
    ratio = x / trial  # [rows, n]
    weight = trial.double().pow(_ERR_NORM)
    scores = _grid_scores_torch(ratio, weight, points, -qzero, maxq - qzero)
    best = points[int(np.argmin(scores))]
    if refine:
        fine = list(range(max(0, best - 7), min(97, best + 8)))
        best = fine[int(np.argmin(_grid_scores_torch(ratio, weight, fine, -qzero, maxq - qzero)))]
    return qscale, smax, best


def _search_numpy(
    x: torch.Tensor, bits: int, points: list[int], *, refine: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    # numpy throughout: torch's per-op overhead on these small arrays is larger than the
    # work, and numpy reads x (a column slice of the GPTQ buffer) in place. The same
    # float32 arithmetic as _search_torch up to the scores, whose sums run in float32
    # GEMVs (the argmin of sums of positive terms does not need float64).
    maxq, qzero = 2**bits - 1, 2 ** (bits - 1)
    xn = x.numpy()
    base = (np.abs(xn).max(axis=0) + 1e-12) / (maxq / 2)
    smax = base.max()
    qscale = np.clip(np.rint(np.sqrt(base / smax) * 16), 1, 16)
    trial = (qscale / 16) ** 2 * smax
    ratio = xn / trial  # [rows, n]
    weight = trial.astype(np.float64) ** _ERR_NORM
    weight = (weight / weight.max()).astype(np.float32)  # a common factor: same argmin
    scores = _grid_scores_numpy(ratio, weight, points, -qzero, maxq - qzero)
    best = points[int(np.argmin(scores))]
    if refine:
        fine = list(range(max(0, best - 7), min(97, best + 8)))
        best = fine[int(np.argmin(_grid_scores_numpy(ratio, weight, fine, -qzero, maxq - qzero)))]
    return torch.from_numpy(qscale), torch.from_numpy(np.asarray(smax)), best


def dequant_scales(scale_codes: torch.Tensor, scale_max: torch.Tensor) -> torch.Tensor:
    """fp16 scales [n] of one group, rounded as engine.quant.exl2.exl2_scales rounds them
    (that function takes packed codes; this one is the same arithmetic on one group, so
    the GPTQ loop needs no pack/unpack per group; check_reconstruction holds them equal)."""
    squares = ((scale_codes + 1) * (scale_codes + 1)).to(torch.float16)
    premultiplied = (scale_max.float() / 256).to(torch.float16)
    return (squares.float() * premultiplied.float()).to(torch.float16)


def _grid_scores_numpy(
    ratio: np.ndarray, weight: np.ndarray, points: list[int], qmin: int, qmax: int
) -> np.ndarray:
    """Σ_c weight_c · Σ_r |clip(round(r/p))·p − r|^3.5 per point, up to one common factor.

    In column blocks that stay in cache. The error is taken in units of p (e = clip(round(y))
    − y with y = r/p, the rounding decided on the same y as the converter's rule), so p^3.5
    comes out of the sum and each point costs eight passes and a GEMV."""
    rows, n = ratio.shape
    block = max(1, _GRID_ELEMENTS // max(1, rows))
    scores = np.zeros(len(points))
    buf = np.empty((3, rows, min(block, n)), dtype=np.float32)
    for c0 in range(0, n, block):
        r = ratio[:, c0 : c0 + block]
        w = weight[c0 : c0 + block]
        y, e, t = (b[:, : r.shape[1]] for b in buf)
        for j, i in enumerate(points):
            p = _P_VALUES[i]
            np.multiply(r, 1.0 / p, out=y)
            np.rint(y, out=e)
            np.clip(e, qmin, qmax, out=e)
            e -= y
            e *= e  # e²
            # |e|^3.5 = e² · sqrt(e² · |e|): a fraction of pow's cost.
            np.sqrt(e, out=t)
            t *= e
            np.sqrt(t, out=t)
            t *= e
            scores[j] += float((t @ w).sum()) * p**_ERR_NORM
    return scores


def _grid_scores_torch(
    ratio: torch.Tensor, weight: torch.Tensor, points: list[int], qmin: int, qmax: int
) -> np.ndarray:
    ps = torch.tensor([_P_VALUES[i] for i in points], device=ratio.device)[:, None, None]
    e = (torch.clamp(torch.round(ratio[None] / ps), qmin, qmax) * ps - ratio[None]).abs()
    per_column = e.pow(_ERR_NORM).sum(dim=1).double()  # [p, n]
    return (per_column @ weight.to(per_column)).cpu().numpy()
