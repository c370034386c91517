"""Sweep the batch-1 GEMV's launch settings on a GPU, per linear shape of a real model.

    python tools/tune_gemv.py --shape llama3-8b --format gptq --out DIR

Loads tools/bench.py's random-weight model and, for every linear shape, times
`_launch_gemv` over *every* linear of that shape in turn (one launch per segment into a
preallocated fp16 output, the whole round replayed in a CUDA graph), for every combination
of warps per program, columns per thread, programs per SM, chunks per program and
prefetch. Cycling through all layers' weights (32 x 9 MB for the 8B model's o_proj) keeps
them out of the 50-60 MB L2, as in a real decode step: timing one weight over and over
measures L2, not HBM, for the small shapes. Prints the best settings per shape with the
fraction of the measured read bandwidth and the best single setting over the whole model,
and writes tune.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import torch

from engine.engine import Engine, EngineOptions
from engine.quantized_linear import QuantizedLinear
from kernels.quant_matmul import gemv
from tools.bench import add_model_arguments, model_from_arguments
from tools.profile_decode import _graph_time, _read_bandwidth

ROOT = Path(__file__).resolve().parent.parent

WARPS = (2, 4, 8)
COLS = (4, 8, 16)
PROGRAMS_PER_SM = (2, 4, 8, 16)
MAX_ITERS = (2, 4, 8)
PREFETCH = (False, True)
STAGES = (1,)


def _linears_by_shape(model: torch.nn.Module) -> dict[tuple[int, int], list[QuantizedLinear]]:
    shapes: dict[tuple[int, int], list[QuantizedLinear]] = {}
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear):
            shapes.setdefault((mod.in_features, mod.out_features), []).append(mod)
    return shapes


def _key(config: gemv.GemvConfig) -> str:
    return (
        f"w{config.num_warps} c{config.cols_per_thread[0]} p{config.programs_per_sm} "
        f"i{config.max_iters}{' pf' if config.prefetch else ''}"
        f"{f' s{config.stages}' if config.stages > 1 else ''}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--warps", type=int, nargs="+", default=list(WARPS))
    parser.add_argument("--cols", type=int, nargs="+", default=list(COLS))
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=list(PROGRAMS_PER_SM))
    parser.add_argument("--max-iters", type=int, nargs="+", default=list(MAX_ITERS))
    parser.add_argument("--prefetch", choices=["on", "off", "both"], default="both")
    parser.add_argument(
        "--stages", type=int, nargs="+", default=list(STAGES),
        help="software-pipeline stages of the chunk loop (GemvConfig.stages; 1: none)",
    )  # fmt: skip
    args = parser.parse_args()
    path, out = model_from_arguments(args)
    engine = Engine.load(
        path,
        EngineOptions(device="cuda", dtype="float16", max_seq_len=256),
    )
    bandwidth = _read_bandwidth()
    default = gemv._GEMV_CONFIG
    prefetch_values = {"on": (True,), "off": (False,), "both": PREFETCH}[args.prefetch]
    configs = [
        gemv.GemvConfig(warps, (cols, cols, 4, 4), pps, iters, prefetch, stages)
        for warps, cols, pps, iters, prefetch, stages in itertools.product(
            args.warps,
            args.cols,
            args.programs_per_sm,
            args.max_iters,
            prefetch_values,
            args.stages,
        )
    ]
    if default not in configs:
        configs.append(default)

    results = []
    for (k, n), mods in _linears_by_shape(engine.model).items():
        nbytes = mods[0].storage_bits // 8
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        y = torch.empty(1, n, device="cuda", dtype=torch.float16)

        def round_of_calls(mods=mods, x=x, y=y) -> None:
            for mod in mods:
                gemv.launch_gemv(x, mod.qweight, y)

        rows = []
        for config in configs:
            gemv._GEMV_CONFIG = config
            try:
                secs = _graph_time(round_of_calls, calls=4, reps=5) / len(mods)
            except Exception as e:  # a configuration that does not compile (registers)
                print(f"  {k}x{n} {_key(config)}: {type(e).__name__}")
                continue
            finally:
                gemv._GEMV_CONFIG = default
            rows.append(
                {
                    "config": dataclasses.asdict(config),
                    "key": _key(config),
                    "us": secs * 1e6,
                    "fraction_of_bw": nbytes / secs / bandwidth,
                }
            )
        default_row = next(r for r in rows if r["key"] == _key(default))
        results.append(
            {"k": k, "n": n, "count": len(mods), "bytes": nbytes, "default": default_row,
             "all": list(rows)}
        )  # fmt: skip
        rows.sort(key=lambda r: r["us"])
        print(f"{k}x{n} x{len(mods)} ({nbytes / 1e6:.1f} MB): default {default_row['us']:.2f} us "
              f"({default_row['fraction_of_bw']:.2f} of bw)")  # fmt: skip
        for r in rows[:6]:
            print(f"    {r['us']:7.2f} us {r['fraction_of_bw']:.2f}  {r['key']}")
    # One setting for all shapes: the least time over every linear of the model; and the
    # sum of each shape's best (what per-shape settings could give).
    totals: dict[str, float] = {}
    for shape in results:
        for r in shape["all"]:
            totals[r["key"]] = totals.get(r["key"], 0.0) + r["us"] * shape["count"]
    per_shape_best = sum(min(r["us"] for r in s["all"]) * s["count"] for s in results)
    print(f"all linears, default {_key(default)}: {totals[_key(default)]:.0f} us per token")
    print(f"all linears, each shape's best: {per_shape_best:.0f} us per token")
    for key, us in sorted(totals.items(), key=lambda kv: kv[1])[:8]:
        print(f"    {us:7.0f} us  {key}")
    (out / "tune.json").write_text(
        json.dumps(
            {
                "gpu": torch.cuda.get_device_name(),
                "format": args.format,
                "read_bandwidth_gb_s": bandwidth / 1e9,
                "default_total_us": totals[_key(default)],
                "per_shape_best_total_us": per_shape_best,
                "totals_us": dict(sorted(totals.items(), key=lambda kv: kv[1])),
                "shapes": results,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
