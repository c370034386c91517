"""Time the quantized matmul paths at batched-decode sizes on a GPU (M = 1 .. 128 rows).

    python tools/tune_mid_m.py --shape llama3-8b --format gptq --out DIR

Batched decode, speculative verification and short prefill chunks multiply M activation
rows with every linear. This loads tools/bench.py's random-weight model and times one
round of `quant_matmul_triton` over *every* linear of the model in turn (as a decode step
reads them: 32 layers' weights cycle through the 50-60 MB L2, so this is HBM, not L2),
replayed in a CUDA graph:
  - per M, each path (gemv for M <= 4, the tensor-core "dot" path, dequantize + cuBLAS);
  - for the dot path at the --sweep-m sizes, every DotConfig of the sweep below.
Reports µs per round and the effective GB/s of the packed weights, and writes
tune_mid_m.json. The tables in kernels/quant_matmul/dot.py came from this sweep and the finer
ones recorded in bench/results/2026-11-25-h100-mid-m-fold-and-decode-attention-s8.json
(chunks per slice, 16-row tiles at M <= 16). A fold-2 config on a weight that cannot
fold (bf16, fractional zero points) runs the unfolded table instead: sweep an fp16 GPTQ or
EXL2 model.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.engine import Engine, EngineOptions  # noqa: E402
from engine.quantized_linear import QuantizedLinear  # noqa: E402
from kernels.quant_matmul import dot as quant_dot  # noqa: E402
from kernels.quant_matmul import paths, quant_matmul_triton  # noqa: E402
from tools.bench import add_model_arguments, model_from_arguments  # noqa: E402
from tools.profile_decode import _graph_time, _read_bandwidth  # noqa: E402

M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128)
# The dot sweep: (transposed, fold, rows per tile, block_n, max_block_k, warps, programs
# per SM). Folding (DotConfig.fold) applies to this tool's fp16 GPTQ model.
DOT_SWEEP = list(
    itertools.product((True, False), (0, 2), (16, 32, 64), (64, 128), (64, 128), (4, 8), (2, 4))
)


def _config(values: tuple) -> quant_dot.DotConfig:
    transposed, fold, block_m, block_n, block_k, warps, pps = values
    return quant_dot.DotConfig(
        transposed=transposed,
        fold=fold,
        min_block_m=block_m,
        max_block_m=block_m,
        block_n=block_n,
        max_block_k=block_k,
        num_warps=warps,
        programs_per_sm=pps,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--m", type=int, nargs="*", default=list(M_VALUES))
    parser.add_argument("--sweep-m", type=int, nargs="*", default=[8, 64])
    args = parser.parse_args()
    path, out = model_from_arguments(args)
    engine = Engine.load(path, EngineOptions(device="cuda", dtype="float16", max_seq_len=256))
    bandwidth = _read_bandwidth()
    linears = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
    step_bytes = sum(m.storage_bits // 8 for m in linears)
    default = quant_dot._DOT_CONFIGS

    def round_us(M: int, path: str) -> float | None:
        """µs of one call of every linear at M rows through `path` (None: it fails)."""
        xs = {
            k: torch.randn(M, k, device="cuda", dtype=torch.float16)
            for k in {m.in_features for m in linears}
        }

        def round_of_calls() -> None:
            for mod in linears:
                quant_matmul_triton(xs[mod.in_features], mod.qweight, path=path)

        try:
            return _graph_time(round_of_calls, calls=1, reps=5) * 1e6
        except Exception as e:  # e.g. out of registers / shared memory for a config
            print(f"    M={M} {path}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            return None

    def gb_s(us: float) -> float:
        return step_bytes / (us * 1e-6) / 1e9

    paths_rows = []
    for M in args.m:
        row: dict = {"M": M}
        for p in ("gemv", "dot", "dequant"):
            if p == "gemv" and M > paths.GEMV_LIMIT_M:
                continue
            row[p] = round_us(M, p)
        best = min((v, p) for p, v in row.items() if p != "M" and v is not None)
        row["best"] = best[1]
        row["gb_s_best"] = gb_s(best[0])
        paths_rows.append(row)
        print(json.dumps(row), flush=True)

    sweep = []
    for M in args.sweep_m:
        for values in DOT_SWEEP:
            config = _config(values)
            if config.min_block_m > max(16, M):
                continue
            quant_dot._DOT_CONFIGS = ((1 << 62, config),)
            us = round_us(M, "dot")
            if us is not None:
                sweep.append({"M": M, **dataclasses.asdict(config), "us": us,
                              "gb_s": gb_s(us)})  # fmt: skip
        quant_dot._DOT_CONFIGS = default
        best = sorted((r for r in sweep if r["M"] == M), key=lambda r: r["us"])[:8]
        print(f"M={M}: best dot settings (µs per round of linears)", flush=True)
        for r in best:
            print("   ", json.dumps(r), flush=True)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "shape": args.shape,
        "format": args.format,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "step_bytes": step_bytes,
        "default": [[most, dataclasses.asdict(c)] for most, c in default],
        "paths": paths_rows,
        "dot_sweep": sweep,
    }
    (out / "tune_mid_m.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
