"""Issue 31, session 11: per-shape decode GEMV time (batch 1) of the tree on PYTHONPATH.

    PYTHONPATH=TREE python gemv31.py --work DIR --label branch|main --json OUT.json \
        [--sweep-seconds 25]

Loads tools/bench.py's random-weight llama3-8b (built by the bench into --work) and, for
every linear shape, times `gemv.launch_gemv` over every linear of that shape in turn in a
CUDA graph (as tools/tune_gemv.py: all layers' weights cycled, out of L2), with
programmatic dependent launch as in decode. On main that is the float32-atomic GEMV; on the
branch (kernels/quant_matmul/slot_sum.py present) the GEMV's partials + the slot sum, and
also: the GEMV's partials alone, the slot sum alone, and (for --sweep-seconds) slot-sum
configs. Also counts, over 30 eager calls of one weight, calls whose fp16 y differs from the
first call's in any bit.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.engine import Engine, EngineOptions
from engine.quantized_linear import QuantizedLinear
from kernels.quant_matmul import gemv
from tools.bench import build_model
from tools.profile_decode import _graph_time, _read_bandwidth

try:
    from kernels.quant_matmul import slot_sum
except ImportError:  # main's tree
    slot_sum = None

SWEEP = [(32, 1), (64, 2), (128, 4), (64, 1), (128, 2), (256, 4), (128, 1), (256, 2), (512, 4)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--format", default="gptq")
    parser.add_argument("--label", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--sweep-seconds", type=float, default=0.0)
    parser.add_argument("--shape", default="llama3-8b")
    # --dry: the tiny shape on the CPU under TRITON_INTERPRET=1, each timing one plain call
    # (checks this script without a GPU).
    parser.add_argument("--dry", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.dry else "cuda"
    timer = _graph_time
    if args.dry:

        def timer(fn, calls: int, reps: int) -> float:  # noqa: ARG001
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t

    t0 = time.time()
    path = build_model(
        Path(args.work) / f"{args.shape}-{args.format}", args.shape, args.format, device=device
    )
    engine = Engine.load(path, EngineOptions(device=device, dtype="float16", max_seq_len=256))
    print(f"[{args.label}] loaded in {time.time() - t0:.1f} s", flush=True)
    bandwidth = 1e12 if args.dry else _read_bandwidth()
    shapes: dict[tuple[int, int], list[QuantizedLinear]] = {}
    for mod in engine.model.modules():
        if isinstance(mod, QuantizedLinear):
            shapes.setdefault((mod.in_features, mod.out_features), []).append(mod)

    results = []
    swept_seconds = 0.0
    for (k, n), mods in shapes.items():
        nbytes = mods[0].storage_bits // 8
        x = torch.randn(1, k, device=device, dtype=torch.float16)
        y = torch.empty(1, n, device=device, dtype=torch.float16)

        def whole(mods=mods, x=x, y=y) -> None:
            for mod in mods:
                gemv.launch_gemv(x, mod.qweight, y)

        row: dict = {"k": k, "n": n, "count": len(mods), "bytes": nbytes}
        secs = timer(whole, calls=4, reps=5) / len(mods)
        row["us"] = secs * 1e6
        row["fraction_of_bw"] = nbytes / secs / bandwidth
        first = None
        differ = 0
        for _ in range(30):
            gemv.launch_gemv(x, mods[0].qweight, y)
            if first is None:
                first = y.clone()
            elif not torch.equal(y, first):
                differ += 1
        row["nondeterministic_of_30"] = differ
        tiling = gemv.gemv_tiling(x, mods[0].qweight)
        row["tiles"] = tiling.n_tiles
        row["splits"] = tiling.arrivals
        if slot_sum is not None:
            from kernels.quant_matmul.split_k import split_k_workspace

            slots = gemv.gemv_slots(tiling)
            sums, _ = split_k_workspace(x.device, slots * n, 0)
            default = slot_sum.slot_sum_config(n, slots, x.device)
            row["slot_sum_default"] = [default.block, default.num_warps]

            def partials(mods=mods, x=x, sums=sums, tiling=tiling) -> None:
                for mod in mods:
                    gemv.launch_gemv_partials(x, mod.qweight, sums, tiling)

            def sums_only(mods=mods, y=y, sums=sums, slots=slots) -> None:
                for _ in mods:
                    slot_sum.launch_slot_sum(sums, y, slots)

            row["partials_only_us"] = timer(partials, calls=4, reps=5) / len(mods) * 1e6
            row["slot_sum_only_us"] = timer(sums_only, calls=4, reps=5) / len(mods) * 1e6
            row["sweep"] = {}
            for block, warps in SWEEP:
                if swept_seconds >= args.sweep_seconds:
                    break
                started = time.time()
                config = slot_sum.SlotSumConfig(block, warps)

                def swept(mods=mods, x=x, y=y, sums=sums, tiling=tiling, slots=slots,
                          config=config) -> None:  # fmt: skip
                    for mod in mods:
                        gemv.launch_gemv_partials(x, mod.qweight, sums, tiling)
                        slot_sum.launch_slot_sum(sums, y, slots, config=config)

                us = timer(swept, calls=4, reps=5) / len(mods) * 1e6
                row["sweep"][f"b{block} w{warps}"] = us
                swept_seconds += time.time() - started
        results.append(row)
        extra = ""
        if slot_sum is not None:
            extra = (
                f" partials {row['partials_only_us']:.2f} sum {row['slot_sum_only_us']:.2f}"
                f" cfg {row['slot_sum_default']} sweep "
                + " ".join(f"{key}:{us:.2f}" for key, us in row["sweep"].items())
            )
        print(
            f"[{args.label}] {k}x{n} x{len(mods)} splits {row['splits']} tiles {row['tiles']}: "
            f"{row['us']:.2f} us ({row['fraction_of_bw']:.2f} of bw) "
            f"nondet {differ}/30{extra}",
            flush=True,
        )
    total = sum(r["us"] * r["count"] for r in results)
    print(f"[{args.label}] all linears of a token: {total:.0f} us", flush=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "label": args.label,
                "gpu": "dry" if args.dry else torch.cuda.get_device_name(),
                "read_bandwidth_gb_s": bandwidth / 1e9,
                "all_linears_us": total,
                "shapes": results,
                "seconds": time.time() - t0,
            },
            indent=1,
        )
    )
    engine.unload()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
