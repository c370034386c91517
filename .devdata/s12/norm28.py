"""add_rms_norm / rms_norm µs at decode and prefill row counts (8B: D=4096), for the tree on
PYTHONPATH: run once per tree (review of issue 28: the pairwise tree's cost in prefill and in
the norms that still launch). Prints one JSON line."""

import json
import sys

import torch
from triton.testing import do_bench

import kernels

out = {"tree": sys.argv[1]}
for rows in (1, 2, 512, 8192):
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.float16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=torch.float16)
    out[f"add_rms_norm_us_{rows}"] = round(
        1000
        * do_bench(lambda x=x, r=r, w=w: kernels.add_rms_norm(x, r, w, 1e-5), warmup=50, rep=200),
        2,
    )
    out[f"rms_norm_us_{rows}"] = round(
        1000 * do_bench(lambda x=x, w=w: kernels.rms_norm(x, w, 1e-5), warmup=50, rep=200), 2
    )
print("NORM28", json.dumps(out))
