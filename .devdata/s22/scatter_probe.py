"""Issue 28, session 22: what the scatter costs the slot sums, alone (8B EXL2 weights, every
layer's in turn, CUDA graph, tools/tune_gemv.py's method).
  gate_up + silu slot sum (SlotNorm): no scatter / scatter = down's row order / scatter =
  identity (the index path without scattered stores); o_proj + residual slot sum with xw:
  no scatter / xw_scatter = gate_up's row order / identity.
    python .devdata/s22/scatter_probe.py OUT_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from engine.engine import Engine, EngineOptions
from engine.quantized_linear import QuantizedLinear
from kernels.quant_matmul import gemv
from kernels.quant_matmul.slot_sum import RowSquares, SlotNorm
from kernels.quant_matmul.split_k import row_order
from tools.bench import build_model
from tools.profile_decode import _graph_time


def main() -> int:
    out = Path(sys.argv[1])
    path = build_model(Path("/tmp/kestrel-bench/llama3-8b-exl2"), "llama3-8b", "exl2")
    engine = Engine.load(path, EngineOptions(device="cuda", dtype="float16", max_seq_len=256))
    mods = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]

    def of(k: int, n: int) -> list:
        return [m.qweight for m in mods if (m.in_features, m.out_features) == (k, n)]

    gate_up, down, o_proj = of(4096, 28672), of(14336, 4096), of(4096, 4096)
    result: dict = {"gpu": torch.cuda.get_device_name()}
    squares = RowSquares(torch.rand(1, 32, device="cuda"), 128)
    norm = SlotNorm(squares, 4096, 1e-5)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.float32)
    y = torch.empty(1, 14336, device="cuda", dtype=torch.float16)
    ident = torch.arange(14336, dtype=torch.int32, device="cuda")
    scatters = {
        "none": [None] * 32,
        "row_order": [row_order(q) for q in down],
        "identity": [ident] * 32,
    }
    for name, sc in scatters.items():

        def gate_up_round(sc=sc) -> None:
            for qw, s in zip(gate_up, sc, strict=True):
                gemv.launch_gemv(x, qw, y, silu_mul=True, norm=norm, x_in_row_order=True, scatter=s)

        result[f"gate_up_silu/{name}"] = _graph_time(gate_up_round, calls=4, reps=7) / 32 * 1e6
        print(f"gate_up_silu {name}: {result[f'gate_up_silu/{name}']:.2f} us", flush=True)
    xo = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    res = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    h = torch.empty_like(res)
    w = torch.rand(4096, device="cuda", dtype=torch.float16)
    xw = torch.empty(1, 4096, device="cuda", dtype=torch.float32)
    ident4 = torch.arange(4096, dtype=torch.int32, device="cuda")
    scatters = {
        "none": [None] * 32,
        "row_order": [row_order(q) for q in gate_up],
        "identity": [ident4] * 32,
    }
    for name, sc in scatters.items():

        def o_round(sc=sc) -> None:
            for qw, s in zip(o_proj, sc, strict=True):
                gemv.launch_gemv_residual(xo, qw, res, h, norm_weight=w, xw=xw, xw_scatter=s)

        result[f"o_residual/{name}"] = _graph_time(o_round, calls=4, reps=7) / 32 * 1e6
        print(f"o_residual {name}: {result[f'o_residual/{name}']:.2f} us", flush=True)
    out.write_text(json.dumps(result, indent=1))
    engine.unload()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
