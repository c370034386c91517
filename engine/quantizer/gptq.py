"""GPTQ for one linear into EXL2 groups: act-order, damping, blockwise error feedback.

    result = gptq_quantize(weight [n, k], hessian [k, k], profile, name=...)
    tensors = result.pack(bias)            # pack_exl2 output, reconstruction-checked

Contract:
- `hessian` is Σ XᵀX over the calibration inputs of the linear (fp32); inputs never seen
  (zero diagonal) get a unit diagonal so the inverse exists.
- Rows (input features) are permuted by argsort(diag H, descending) (stable), so the
  widest groups of the profile cover the most active inputs. H is damped by
  `damp`·mean(diag H); when the Cholesky factorization fails, the damping grows (up to 8
  more times) before `QuantizationError` names the tensor.
- Groups are quantized in order. Each group's scales are fitted on the group's weights as
  the error feedback of earlier groups left them (the converter's order), with
  `fit_scales`; codes are rounded to nearest; each row's error is spread over the
  group's later rows through the inverse Hessian's Cholesky factor, and the group's error
  over all later rows with one matmul.
- `result.dequantized` [n, k] fp32 (original order) is exactly what dequantize_exl2 gives
  back from `result.pack()`; pack() checks that and raises `QuantizationError` naming
  the tensor on a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.quant.exl2 import Exl2Tensors, dequantize_exl2
from engine.quant.exl2_writer import fit_exl2_scales, pack_exl2
from engine.quantizer.profiles import Profile

DEFAULT_DAMP = 0.1
_DAMP_RETRIES = 8
# The converter's scale search: factors p on 97 points in [0.70, 1.20], score Σ|err|^3.5.
_P_GRID = torch.linspace(0, 1, 97, dtype=torch.float64)
_P_VALUES = (0.70 * (1 - _P_GRID) + 1.20 * _P_GRID).tolist()
_ERR_NORM = 3.5
SCALE_SEARCHES = ("full", "fast", "coarse")


class QuantizationError(RuntimeError):
    """Quantizing a tensor failed (a singular Hessian, a packed result that does not read
    back as computed); the message names the tensor."""


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
    maxq, qzero = 2**bits - 1, 2 ** (bits - 1)
    base = (x.abs().amax(dim=0) + 1e-12) / (maxq / 2)
    smax = base.max()
    qscale = torch.clamp(torch.round(torch.sqrt(base / smax) * 16), 1, 16)
    trial = (qscale / 16) ** 2 * smax
    # Σ|q·s·p − x|^3.5 = Σ_c trial_c^3.5 · Σ_r |round(r/p)·p − r|^3.5 with r = x / trial.
    ratio = x / trial  # [rows, n]
    weight = trial.double().pow(_ERR_NORM)
    score = _grid_scores_numpy if x.device.type == "cpu" else _grid_scores_torch
    coarse = list(range(0, 97, 8 if search == "fast" else 16))
    scores = score(ratio, weight, coarse, -qzero, maxq - qzero)
    best = coarse[int(np.argmin(scores))]
    if search == "fast":
        fine = list(range(max(0, best - 7), min(97, best + 8)))
        best = fine[int(np.argmin(score(ratio, weight, fine, -qzero, maxq - qzero)))]
    scale_codes = qscale.to(torch.int32) - 1
    scale_max = (smax * _P_VALUES[best]).to(torch.float16)
    return scale_codes, scale_max, dequant_scales(scale_codes, scale_max)


def dequant_scales(scale_codes: torch.Tensor, scale_max: torch.Tensor) -> torch.Tensor:
    """fp16 scales [n] of one group, rounded as engine.quant.exl2.exl2_scales rounds them
    (that function takes packed codes; this one is the same arithmetic on one group, so
    the GPTQ loop needs no pack/unpack per group; check_reconstruction holds them equal)."""
    squares = ((scale_codes + 1) * (scale_codes + 1)).to(torch.float16)
    premultiplied = (scale_max.float() / 256).to(torch.float16)
    return (squares.float() * premultiplied.float()).to(torch.float16)


def _grid_scores_numpy(
    ratio: torch.Tensor, weight: torch.Tensor, points: list[int], qmin: int, qmax: int
) -> np.ndarray:
    # numpy, in column blocks that stay in cache: torch's per-op threading overhead on
    # small tensors is larger than the work here.
    r_all = ratio.t().contiguous().numpy()  # [n, rows]
    w_all = weight.numpy()
    n, rows = r_all.shape
    scores = np.zeros(len(points))
    block = max(1, 16384 // max(1, rows))
    buf = np.empty((2, min(block, n), rows), dtype=np.float32)
    for c0 in range(0, n, block):
        r = r_all[c0 : c0 + block]
        w = w_all[c0 : c0 + block]
        b, t = buf[0, : r.shape[0]], buf[1, : r.shape[0]]
        for j, i in enumerate(points):
            p = _P_VALUES[i]
            np.multiply(r, 1.0 / p, out=b)
            np.rint(b, out=b)
            np.clip(b, qmin, qmax, out=b)
            b *= p
            b -= r
            np.abs(b, out=b)
            # |e|^3.5 as e^2 · e · sqrt(e): a fraction of pow's cost.
            np.sqrt(b, out=t)
            t *= b
            b *= b
            b *= t
            scores[j] += float(b.sum(axis=1, dtype=np.float64) @ w)
    return scores


def _grid_scores_torch(
    ratio: torch.Tensor, weight: torch.Tensor, points: list[int], qmin: int, qmax: int
) -> np.ndarray:
    ps = torch.tensor([_P_VALUES[i] for i in points], device=ratio.device)[:, None, None]
    e = (torch.clamp(torch.round(ratio[None] / ps), qmin, qmax) * ps - ratio[None]).abs()
    per_column = e.pow(_ERR_NORM).sum(dim=1).double()  # [p, n]
    return (per_column @ weight.to(per_column)).cpu().numpy()


@dataclass
class GptqResult:
    name: str
    codes: torch.Tensor  # int32 [k, n], stored (permuted) row order
    group_bits: list[int]
    group_sizes: list[int]
    scale_codes: torch.Tensor  # int32 [G, n]
    scale_max: torch.Tensor  # fp16 [G]
    invperm: torch.Tensor  # int64 [k]
    dequantized: torch.Tensor  # fp32 [n, k], HF layout, original row order

    def pack(self, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        tensors = pack_exl2(
            self.codes,
            self.group_bits,
            self.group_sizes,
            self.scale_codes,
            self.scale_max,
            self.invperm,
            bias,
        )
        check_reconstruction(self.name, tensors, self.dequantized)
        return tensors


def check_reconstruction(
    name: str, tensors: dict[str, torch.Tensor], expected: torch.Tensor
) -> None:
    """Dequantize packed tensors and compare with the quantizer's own result [n, k]."""
    n = expected.shape[0]
    got = dequantize_exl2(Exl2Tensors.from_dict(tensors), out_features=n).t()
    diff = (got - expected.to(got)).abs().max().item()
    tolerance = 1e-5 * max(1.0, expected.abs().max().item())
    if not diff <= tolerance:
        raise QuantizationError(
            f"{name}: the packed EXL2 tensors do not reconstruct the quantized weight "
            f"(max difference {diff:.3g}, tolerance {tolerance:.3g})"
        )


def prepare_hessian(
    hessian: torch.Tensor, *, damp: float = DEFAULT_DAMP, name: str = "linear"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, U): the act-order permutation and the upper Cholesky factor of the damped,
    permuted inverse Hessian. Linears sharing an input share this."""
    h = hessian.detach().to(torch.float32).clone()
    k = h.shape[0]
    diag = torch.diagonal(h)
    dead = diag <= 0
    if bool(dead.any()):
        diag[dead] = 1.0
    perm = torch.argsort(diag, descending=True, stable=True)
    h = h[perm][:, perm]
    step = damp * float(torch.diagonal(h).mean())
    step = max(step, 1e-6)
    idx = torch.arange(k, device=h.device)
    for _ in range(_DAMP_RETRIES + 1):
        h[idx, idx] += step
        chol, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0 and bool(torch.isfinite(upper).all()):
                return perm, upper
        step *= 2  # more damping shifts the eigenvalues further from zero
    raise QuantizationError(f"{name}: the Hessian is not positive definite even with damping")


def rtn_factors(k: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, U) that make gptq_quantize round to nearest: no act-order, and U = I passes no
    error to later rows. The baseline GPTQ is measured against, on the same scale grid."""
    return torch.arange(k, device=device), torch.eye(k, device=device)


def gptq_quantize(
    weight: torch.Tensor,
    perm: torch.Tensor,
    upper: torch.Tensor,
    profile: Profile,
    *,
    name: str = "linear",
    scale_search: str = "full",
) -> GptqResult:
    """GPTQ of weight [n, k] (HF layout) with a prepared (perm, U) (see module docstring)."""
    n, k = weight.shape
    w = weight.detach().to(device=upper.device, dtype=torch.float32).t()[perm].contiguous()
    group_bits, group_sizes = profile.layout(k)
    codes = torch.empty(k, n, dtype=torch.int32, device=w.device)
    quant = torch.empty_like(w)
    scale_codes, scale_max = [], []
    a = 0
    for bits, size in zip(group_bits, group_sizes, strict=True):
        b = a + size
        sc, smax, scale = fit_scales(w[a:b], bits, scale_search)
        scale_codes.append(sc)
        scale_max.append(smax)
        s = scale.float()
        s = torch.where(s == 0, torch.ones_like(s), s)  # an all-zero column: codes stay zero
        rows = _quantize_rows_numpy if w.device.type == "cpu" else _quantize_rows_torch
        signed, err = rows(w[a:b], upper[a:b, a:b], s, bits, quant[a:b])
        codes[a:b] = signed.to(torch.int32) + 2 ** (bits - 1)
        if b < k:
            w[b:].addmm_(upper[a:b, b:].t(), err, alpha=-1.0)
        a = b
    invperm = torch.argsort(perm)
    return GptqResult(
        name=name,
        codes=codes,
        group_bits=group_bits,
        group_sizes=group_sizes,
        scale_codes=torch.stack(scale_codes),
        scale_max=torch.stack(scale_max),
        invperm=invperm,
        dequantized=quant[invperm].t().contiguous(),
    )


# The row loop is sequential by nature (each row sees the error of the rows before it in
# its group). Row i's correction is gathered when it is reached, U[a:i, i]ᵀ·E[a:i] (one
# GEMV), rather than pushed to all later rows after each row: the same arithmetic with
# one small op fewer per row. On the CPU numpy runs these vector ops with a fraction of
# torch's per-call overhead, which is what the loop's time is made of.


def _quantize_rows_numpy(
    w: torch.Tensor, u: torch.Tensor, scale: torch.Tensor, bits: int, quant_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows w [g, n] in order; returns (signed codes [g, n] float, errors [g, n]),
    writes the dequantized rows into quant_out."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    wn, un = w.numpy(), u.contiguous().numpy()
    s = scale.numpy()
    inv_s = 1.0 / s
    g, n = wn.shape
    signed = np.empty((g, n), dtype=np.float32)
    err = np.empty((g, n), dtype=np.float32)
    q = quant_out.numpy()
    row = np.empty(n, dtype=np.float32)
    for i in range(g):
        if i:
            np.subtract(wn[i], un[:i, i] @ err[:i], out=row)
        else:
            row[:] = wn[i]
        c = signed[i]
        np.multiply(row, inv_s, out=c)
        np.rint(c, out=c)
        np.maximum(c, qmin, out=c)
        np.minimum(c, qmax, out=c)
        np.multiply(c, s, out=q[i])
        np.subtract(row, q[i], out=err[i])
        err[i] /= un[i, i]
    return torch.from_numpy(signed), torch.from_numpy(err)


def _quantize_rows_torch(
    w: torch.Tensor, u: torch.Tensor, scale: torch.Tensor, bits: int, quant_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    inv_s = 1.0 / scale
    signed = torch.empty_like(w)
    err = torch.empty_like(w)
    for i in range(w.shape[0]):
        row = w[i] - u[:i, i] @ err[:i] if i else w[i]
        c = torch.clamp(torch.round(row * inv_s), qmin, qmax)
        signed[i] = c
        quant_out[i] = c * scale
        err[i] = (row - quant_out[i]) / u[i, i]
    return signed, err


def output_error(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(ΔW H ΔWᵀ) / tr(W H Wᵀ): the relative squared error of the linear's output over
    the calibration inputs, without running them again."""
    delta = (quantized - weight).float()
    num = torch.einsum("nk,kj,nj->", delta, hessian, delta)
    den = torch.einsum("nk,kj,nj->", weight.float(), hessian, weight.float())
    return float(num / den.clamp_min(1e-30))
