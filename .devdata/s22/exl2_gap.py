"""Issue 28, session 22: where EXL2's decode GEMVs lose to GPTQ's at the same 4 bits
(8B random weights; tools/tune_gemv.py's method: every layer's weight of a shape in turn,
a CUDA graph, cold weights).
  1. Each layer shape with its perm (as loaded) and with perm=None (no gather of x): the
     cost of the act-order gather.
  2. The 6-bit head (two planes: 249 registers at 4 warps x 8 columns with prefetch) under
     GEMV settings with fewer registers.
    python .devdata/s22/exl2_gap.py OUT_JSON
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from engine.engine import Engine, EngineOptions
from engine.quantized_linear import QuantizedLinear
from kernels.quant_matmul import gemv
from tools.bench import build_model
from tools.profile_decode import _graph_time, _read_bandwidth


def main() -> int:
    out = Path(sys.argv[1])
    path = build_model(Path("/tmp/kestrel-bench/llama3-8b-exl2"), "llama3-8b", "exl2")
    engine = Engine.load(path, EngineOptions(device="cuda", dtype="float16", max_seq_len=256))
    bandwidth = _read_bandwidth()
    shapes: dict[tuple[int, int], list[QuantizedLinear]] = {}
    for mod in engine.model.modules():
        if isinstance(mod, QuantizedLinear):
            shapes.setdefault((mod.in_features, mod.out_features), []).append(mod)
    result: dict = {"gpu": torch.cuda.get_device_name(), "bandwidth_gb_s": bandwidth / 1e9}
    default = gemv._GEMV_CONFIG

    def time_round(weights, k: int, n: int) -> float:
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        y = torch.empty(1, n, device="cuda", dtype=torch.float16)

        def round_of_calls() -> None:
            for qw in weights:
                gemv.launch_gemv(x, qw, y)

        return _graph_time(round_of_calls, calls=4, reps=7) / len(weights) * 1e6

    for (k, n), mods in shapes.items():
        nbytes = mods[0].storage_bits // 8
        with_perm = [m.qweight for m in mods]
        no_perm = [dataclasses.replace(m.qweight, perm=None) for m in mods]
        row = {"bytes": nbytes, "count": len(mods)}
        for name, weights in (("perm", with_perm), ("no_perm", no_perm), ("perm2", with_perm)):
            us = time_round(weights, k, n)
            row[name] = {"us": us, "fraction_of_bw": nbytes / (us * 1e-6) / bandwidth}
        if len(mods) == 1:  # the head: settings with fewer registers for its two planes
            for name, config in {
                "c4": dataclasses.replace(default, cols_per_thread=(4, 4, 4, 4)),
                "nopf": dataclasses.replace(default, prefetch=False),
                "c4_nopf": dataclasses.replace(
                    default, cols_per_thread=(4, 4, 4, 4), prefetch=False
                ),
                "w8c4": dataclasses.replace(default, num_warps=8, cols_per_thread=(4, 4, 4, 4)),
                "c4_p4": dataclasses.replace(
                    default, cols_per_thread=(4, 4, 4, 4), programs_per_sm=4
                ),
            }.items():
                gemv._GEMV_CONFIG = config
                try:
                    us = time_round(with_perm, k, n)
                finally:
                    gemv._GEMV_CONFIG = default
                row[name] = {"us": us, "fraction_of_bw": nbytes / (us * 1e-6) / bandwidth}
        result[f"{k}x{n}"] = row
        print(f"{k}x{n}: " + "  ".join(
            f"{key} {v['us']:.2f} us ({v['fraction_of_bw']:.2f})"
            for key, v in row.items() if isinstance(v, dict)
        ), flush=True)  # fmt: skip
        out.write_text(json.dumps(result, indent=1))
    engine.unload()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
