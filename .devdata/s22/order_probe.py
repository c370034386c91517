"""Issue 28, session 22: why the row-order A/B shows no change on the 8B EXL2 decode graph.
1. Eager decode steps under torch.profiler, row order off / on: _gemv_kernel total per
   step, and how many fold GEMVs read x in row order (counted at the call).
2. gate_up alone, every layer's weight in turn (tools/tune_gemv.py's method): gathered x,
   x_in_row_order=True (the engine's path), perm=None (session 22's first measurement).
  python .devdata/s22/order_probe.py OUT_JSON
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from engine import modules, norm_fold
from engine.cache import ForwardBatch, Sequence
from engine.engine import Engine, EngineOptions
from engine.quantized_linear import QuantizedLinear
from kernels.quant_matmul import gemv
from tools.bench import build_model
from tools.profile_decode import _graph_time, kernel_table


def main() -> int:
    out = Path(sys.argv[1])
    path = build_model(Path("/tmp/kestrel-bench/llama3-8b-exl2"), "llama3-8b", "exl2")
    engine = Engine.load(path, EngineOptions(device="cuda", dtype="float16", max_seq_len=1024))
    result: dict = {"gpu": torch.cuda.get_device_name()}
    calls: list[bool] = []
    real = modules.quant_matmul_normed

    def counted(*args, **kwargs):
        calls.append(bool(kwargs.get("x_in_row_order")))
        return real(*args, **kwargs)

    modules.quant_matmul_normed = counted
    seq = Sequence()
    prompt = torch.randint(2, 1000, (512,), generator=torch.Generator().manual_seed(1)).tolist()
    token = int(engine.runner.prefill(seq, prompt)[-1].argmax())

    def step() -> None:
        seq.reserve(engine.cache, seq.length + 1)
        engine.model(ForwardBatch.build(engine.cache, [seq], [[token]]), engine.cache)

    for enabled in (False, True, False, True):
        norm_fold.set_input_row_order(enabled)
        step()
        torch.cuda.synchronize()
        calls.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        table = kernel_table(prof, 3)
        row = {k["name"][:40]: round(k["us"], 1) for k in table[:8]}
        row["row_order_calls"] = sum(calls)
        row["calls"] = len(calls)
        result[f"eager/{'on' if enabled else 'off'}/{len(result)}"] = row
        print(enabled, row, flush=True)
    modules.quant_matmul_normed = real
    norm_fold.set_input_row_order(True)

    mods = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
    for k, n in ((4096, 28672), (14336, 4096)):
        group = [m.qweight for m in mods if (m.in_features, m.out_features) == (k, n)]
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        y = torch.empty(1, n, device="cuda", dtype=torch.float16)
        variants = {
            "gather": (group, False),
            "row_order": (group, True),
            "perm_none": ([dataclasses.replace(q, perm=None) for q in group], False),
        }
        for name, (weights, in_order) in variants.items():

            def round_of_calls(weights=weights, in_order=in_order, x=x, y=y) -> None:
                for qw in weights:
                    gemv.launch_gemv(x, qw, y, x_in_row_order=in_order)

            us = _graph_time(round_of_calls, calls=4, reps=7) / len(weights) * 1e6
            result[f"{k}x{n}/{name}"] = us
            print(f"{k}x{n} {name}: {us:.2f} us", flush=True)
        out.write_text(json.dumps(result, indent=1))
    engine.unload()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
