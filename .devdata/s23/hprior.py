"""Issue 29, session 23 (CPU): a floor under the Hessian's diagonal for input channels the
calibration text barely excites. GPTQ pushes each column's rounding error onto the columns
after it in proportion to H; a channel English text leaves near zero looks free to absorb
error, and text that does excite it (other languages, code) pays. The floor raises
diag(H)_j to at least `floor` x median(diag H) before the usual damping.
    python .devdata/s23/hprior.py FLOOR -- convert.py arguments...
FLOOR 0 is the unchanged quantizer (the control)."""

from __future__ import annotations

import sys

import torch

import convert
from engine.quantizer import quantize

FLOOR = float(sys.argv[1])
_prepare = quantize.prepare_hessian
floored: list[float] = []


def prepare_with_floor(hessian: torch.Tensor, **kwargs):  # type: ignore[no-untyped-def]
    if FLOOR > 0:
        h = hessian.detach().to(torch.float32).clone()
        diag = torch.diagonal(h)
        live = diag[diag > 0]
        floor = FLOOR * float(live.median()) if live.numel() else 0.0
        low = diag < floor
        floored.append(float(low.float().mean()))
        diag[low] = floor
        hessian = h
    return _prepare(hessian, **kwargs)


quantize.prepare_hessian = prepare_with_floor
rc = convert.main(sys.argv[3:])
if floored:
    print(f"floor {FLOOR}: {sum(floored) / len(floored):.3f} of channels raised on average "
          f"over {len(floored)} Hessians", file=sys.stderr)
raise SystemExit(rc)
