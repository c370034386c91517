"""Issue 29, session 24 (CPU): shrink GPTQ's Hessian toward its diagonal. H = XᵀX from a
few thousand tokens of one domain estimates the input channels' correlations, and GPTQ
moves each column's rounding error onto the later columns through them; correlations that
hold only for the calibration domain then misplace the error on other text (session 24's
splice: the MLP's calibration text is what multilingual and code text pay for). The
sample-covariance remedy is shrinkage: H' = H + LAMBDA * diag(H), i.e. (1 + LAMBDA) x
a blend of H and its diagonal with weight LAMBDA / (1 + LAMBDA) on the diagonal, before
the usual damping. LAMBDA 0 is the unchanged quantizer. SCOPE: all | mlp (only the MLP's
linears: gate/up and down).
    python .devdata/s24/shrink.py LAMBDA SCOPE -- convert.py arguments...
"""

from __future__ import annotations

import sys

import torch

import convert
from engine.quantizer import quantize

LAMBDA = float(sys.argv[1])
SCOPE = sys.argv[2]
_prepare = quantize.prepare_hessian
shrunk: list[str] = []


def prepare_shrunk(hessian: torch.Tensor, **kwargs):  # type: ignore[no-untyped-def]
    name = kwargs.get("name", "")
    if LAMBDA > 0 and (SCOPE == "all" or "mlp" in name):
        h = hessian.detach().to(torch.float32).clone()
        diag = torch.diagonal(h)
        diag += LAMBDA * diag.clamp(min=0)
        hessian = h
        shrunk.append(name)
    return _prepare(hessian, **kwargs)


quantize.prepare_hessian = prepare_shrunk
rc = convert.main(sys.argv[4:])
print(f"shrink {LAMBDA} ({SCOPE}): {len(shrunk)} Hessians, e.g. {shrunk[:3]}", file=sys.stderr)
raise SystemExit(rc)
