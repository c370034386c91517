"""Sweep the batch-1 GEMV's tuning constants on a GPU, per linear shape of a real model.

    python tools/tune_gemv.py --shape llama3-8b --format gptq --out DIR

Loads tools/bench.py's random-weight model, takes one linear of each distinct shape and
times `_launch_gemv` alone (one launch per segment into a preallocated fp16 output,
replayed in a CUDA graph of 50 calls) for every combination of warps per program,
columns per thread, programs per SM and chunks per program. Prints the best settings per
shape with the fraction of the measured read bandwidth, and writes tune.json.
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

WARPS = (2, 4, 8)
COLS = (4, 8, 16)
PROGRAMS_PER_SM = (2, 4, 8, 16)
MAX_ITERS = (4, 8, 16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--format", default="gptq", choices=["gptq", "exl2"])
    parser.add_argument("--work", default="/tmp/kestrel-bench")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = build_model(Path(args.work) / f"{args.shape}-{args.format}", args.shape, args.format)
    engine = Engine.load(path, EngineOptions(device="cuda", dtype="float16", max_seq_len=256))
    bandwidth = _read_bandwidth()

    shapes, counts = distinct_linears(engine.model)
    defaults = (
        qmt._GEMV_NUM_WARPS,
        dict(qmt._GEMV_COLS_PER_THREAD),
        qmt._GEMV_PROGRAMS_PER_SM,
        qmt._GEMV_MAX_ITERS,
    )
    results = []
    for (k, n), mod in shapes.items():
        qw = mod.qweight
        nbytes = mod.storage_bits // 8
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        out32 = torch.empty(1, n, device="cuda", dtype=torch.float16)
        rows = []
        for warps, cols, pps, iters in itertools.product(WARPS, COLS, PROGRAMS_PER_SM, MAX_ITERS):
            qmt._GEMV_NUM_WARPS = warps
            qmt._GEMV_COLS_PER_THREAD[1] = cols
            qmt._GEMV_PROGRAMS_PER_SM = pps
            qmt._GEMV_MAX_ITERS = iters
            try:
                secs = _graph_time(lambda qw=qw, x=x, o=out32: qmt._launch_gemv(x, qw, o))
            except Exception as e:  # a configuration that does not compile (registers)
                print(f"  {k}x{n} w{warps} c{cols} p{pps} i{iters}: {type(e).__name__}")
                continue
            rows.append(
                {
                    "warps": warps,
                    "cols": cols,
                    "programs_per_sm": pps,
                    "max_iters": iters,
                    "us": secs * 1e6,
                    "fraction_of_bw": nbytes / secs / bandwidth,
                }
            )
        qmt._GEMV_NUM_WARPS = defaults[0]
        qmt._GEMV_COLS_PER_THREAD.update(defaults[1])
        qmt._GEMV_PROGRAMS_PER_SM, qmt._GEMV_MAX_ITERS = defaults[2], defaults[3]
        default_row = next(
            r
            for r in rows
            if (r["warps"], r["cols"], r["programs_per_sm"], r["max_iters"])
            == (defaults[0], defaults[1][1], defaults[2], defaults[3])
        )
        results.append(
            {"k": k, "n": n, "count": counts[(k, n)], "bytes": nbytes, "default": default_row,
             "all": list(rows)}
        )  # fmt: skip
        rows.sort(key=lambda r: r["us"])
        print(f"{k}x{n} ({nbytes / 1e6:.1f} MB): default {default_row['us']:.2f} us "
              f"({default_row['fraction_of_bw']:.2f} of bw)")  # fmt: skip
        for r in rows[:5]:
            print(f"    {r['us']:7.2f} us {r['fraction_of_bw']:.2f}  w{r['warps']} c{r['cols']} "
                  f"p{r['programs_per_sm']} i{r['max_iters']}")  # fmt: skip
    # One setting for all shapes: the least time over every linear of the model.
    totals: dict[tuple, float] = {}
    for shape in results:
        for r in shape["all"]:
            key = (r["warps"], r["cols"], r["programs_per_sm"], r["max_iters"])
            totals[key] = totals.get(key, 0.0) + r["us"] * shape["count"]
    default_total = totals.get((defaults[0], defaults[1][1], defaults[2], defaults[3]))
    print(f"all linears, default: {default_total:.0f} us per token")
    for key, us in sorted(totals.items(), key=lambda kv: kv[1])[:5]:
        print(f"    {us:7.0f} us  w{key[0]} c{key[1]} p{key[2]} i{key[3]}")
    (out / "tune.json").write_text(
        json.dumps(
            {"gpu": torch.cuda.get_device_name(), "format": args.format, "shapes": results},
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
