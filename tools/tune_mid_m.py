"""Time the quantized matmul paths at batched-decode sizes on a GPU (M = 1 .. 128 rows).

    python tools/tune_mid_m.py --shape llama3-8b --format gptq --out DIR

Batched decode, speculative verification and short prefill chunks multiply M activation
rows with every linear. This loads tools/bench.py's random-weight model, takes one linear
of each distinct shape and times `quant_matmul_triton` per path (gemv for M <= 4, the
tensor-core "dot" path, dequantize + cuBLAS) and, for the dot path, a sweep of its tuning
constants, each replayed in a CUDA graph. Reports per M the summed time over all linears
of one decode step (each shape times its count in the model), so the path thresholds and
the dot constants can be set from numbers. Writes tune_mid_m.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kernels.quant_matmul_triton as qmt  # noqa: E402
from engine.engine import Engine, EngineOptions  # noqa: E402
from tools.bench import build_model  # noqa: E402
from tools.profile_decode import _graph_time, _read_bandwidth, distinct_linears  # noqa: E402

M_VALUES = (1, 2, 3, 4, 5, 8, 16, 32, 64, 128)
# Dot-path sweep: (wide unpack, programs per SM, max BLOCK_K, warps, stages, max BLOCK_M).
# The row-gathering unpack (wide=False) is timed once, at the shipped constants.
DOT_SWEEP = [
    *itertools.product((True,), (1, 2, 4), (32, 64, 128), (4, 8), (3, 4)),
    (False, 2, 64, 4, 3),
]


def _set_dot(wide: bool, pps: int, block_k: int, warps: int, stages: int) -> None:
    qmt._DOT_WIDE, qmt._DOT_PROGRAMS_PER_SM, qmt._DOT_MAX_BLOCK_K = wide, pps, block_k
    qmt._DOT_NUM_WARPS, qmt._DOT_NUM_STAGES = warps, stages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--format", default="gptq", choices=["gptq", "exl2"])
    parser.add_argument("--work", default="/tmp/kestrel-bench")
    parser.add_argument("--out", default=".")
    parser.add_argument("--m", type=int, nargs="*", default=list(M_VALUES))
    parser.add_argument("--sweep-m", type=int, nargs="*", default=[8, 64])
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = build_model(Path(args.work) / f"{args.shape}-{args.format}", args.shape, args.format)
    engine = Engine.load(path, EngineOptions(device="cuda", dtype="float16", max_seq_len=256))
    bandwidth = _read_bandwidth()
    shapes, counts = distinct_linears(engine.model)
    step_bytes = sum(shapes[k].storage_bits // 8 * c for k, c in counts.items())
    defaults = (qmt._DOT_WIDE, qmt._DOT_PROGRAMS_PER_SM, qmt._DOT_MAX_BLOCK_K,
                qmt._DOT_NUM_WARPS, qmt._DOT_NUM_STAGES)  # fmt: skip

    def step_us(M: int, path: str) -> float | None:
        """Summed µs over the model's linears at M rows through one path (None: fails)."""
        total = 0.0
        for key, mod in shapes.items():
            x = torch.randn(M, key[0], device="cuda", dtype=torch.float16)
            try:
                secs = _graph_time(
                    lambda qw=mod.qweight, x=x: qmt.quant_matmul_triton(x, qw, path=path),
                    calls=20,
                )
            except Exception as e:  # e.g. out of registers / shared memory for a config
                print(f"    {key} M={M} {path}: {type(e).__name__}: {str(e)[:120]}")
                return None
            total += secs * 1e6 * counts[key]
        return total

    paths_rows = []
    for M in args.m:
        row: dict = {"M": M}
        for p in ("gemv", "dot", "dequant"):
            if p == "gemv" and M > qmt._GEMV_LIMIT_M:
                continue
            row[p] = step_us(M, p)
        best = min((v, p) for p, v in row.items() if p != "M" and v is not None)
        row["best"] = best[1]
        row["gb_s_best"] = step_bytes / (best[0] * 1e-6) / 1e9
        paths_rows.append(row)
        print(json.dumps(row), flush=True)

    sweep = []
    for M in args.sweep_m:
        for wide, pps, bk, warps, stages in DOT_SWEEP:
            _set_dot(wide, pps, bk, warps, stages)
            us = step_us(M, "dot")
            if us is not None:
                sweep.append({"M": M, "wide": wide, "programs_per_sm": pps, "max_block_k": bk,
                              "warps": warps, "stages": stages, "us": us})  # fmt: skip
        _set_dot(*defaults)
        best = sorted((r for r in sweep if r["M"] == M), key=lambda r: r["us"])[:8]
        print(f"M={M}: best dot settings (µs per step of linears)")
        for r in best:
            print("   ", json.dumps(r))
    result = {
        "gpu": torch.cuda.get_device_name(),
        "shape": args.shape,
        "format": args.format,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "step_bytes": step_bytes,
        "defaults": defaults,
        "paths": paths_rows,
        "dot_sweep": sweep,
    }
    (out / "tune_mid_m.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
