"""Issue 31, session 12: per-shape decode GEMV time (batch 1) of the tree on PYTHONPATH.

    PYTHONPATH=TREE python gemv31b.py --work DIR --label branch|main --json OUT.json \
        [--sweep-seconds 25] [--iters-seconds 40]

Session 12 adds: for the gate_up shape, "gate_up + silu" us = the GEMV followed by
kernels.silu_mul (main, and the branch's unfused route) and, on the branch, the GEMV whose
slot sum writes silu(gate) * up (launch_gemv(silu_mul=True)); and on the branch (with
--iters-seconds) a sweep of the split-K plan: chunks per split (iters) -> splits, programs,
us, for the default (gemv_split_iters), the old rule (powers of two, at most 4) and others.
The GEMV kernel's registers (n_regs, for programs resident per SM) are printed.

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
import inspect
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


def gemv_out(x: torch.Tensor, mod: QuantizedLinear, y: torch.Tensor) -> torch.Tensor:
    gemv.launch_gemv(x, mod.qweight, y)
    return y.clone()


def gemv_registers() -> str:
    """Registers of every compiled GEMV variant (resident programs per SM follow)."""
    found = []
    try:
        for cache in gemv._gemv_kernel.device_caches.values():
            for kernel in cache[0].values():
                regs, spills = getattr(kernel, "n_regs", "?"), getattr(kernel, "n_spills", "?")
                found.append(f"{regs}r/{spills}s")
    except Exception as error:  # diagnostics only
        return f"unknown ({type(error).__name__})"
    return " ".join(sorted(set(found)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--format", default="gptq")
    parser.add_argument("--label", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--sweep-seconds", type=float, default=0.0)
    parser.add_argument("--iters-seconds", type=float, default=0.0)
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
    gate_up_shapes: set[tuple[int, int]] = set()
    for name, mod in engine.model.named_modules():
        if isinstance(mod, QuantizedLinear):
            shapes.setdefault((mod.in_features, mod.out_features), []).append(mod)
            if name.endswith("gate_up_proj"):
                gate_up_shapes.add((mod.in_features, mod.out_features))
    import kernels
    from kernels.quant_matmul import split_k

    fused_silu = "silu_mul" in inspect.signature(gemv.launch_gemv).parameters
    takes_iters = "iters" in inspect.signature(gemv.gemv_tiling).parameters
    iters_swept = 0.0

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
        if (k, n) in gate_up_shapes:
            half = torch.empty(1, n // 2, device=device, dtype=torch.float16)

            def unfused(mods=mods, x=x, y=y) -> None:
                for mod in mods:
                    gemv.launch_gemv(x, mod.qweight, y)
                    kernels.silu_mul(*y.chunk(2, dim=-1), backend="triton")

            row["gate_up_silu_unfused_us"] = timer(unfused, calls=4, reps=5) / len(mods) * 1e6
            if fused_silu:

                def fused(mods=mods, x=x, half=half) -> None:
                    for mod in mods:
                        gemv.launch_gemv(x, mod.qweight, half, silu_mul=True)

                row["gate_up_silu_fused_us"] = timer(fused, calls=4, reps=5) / len(mods) * 1e6
                want = kernels.silu_mul(*gemv_out(x, mods[0], y).chunk(2, dim=-1), backend="triton")
                gemv.launch_gemv(x, mods[0].qweight, half, silu_mul=True)
                row["gate_up_silu_fused_equal_bits"] = bool(torch.equal(half, want))
            print(
                f"[{args.label}] gate_up + silu: unfused {row['gate_up_silu_unfused_us']:.2f} us"
                + (
                    f", fused {row['gate_up_silu_fused_us']:.2f} us (equal bits: "
                    f"{row['gate_up_silu_fused_equal_bits']})"
                    if fused_silu
                    else ""
                ),
                flush=True,
            )
        if takes_iters and args.iters_seconds > 0:
            row["iters_sweep"] = {}
            old_iters = split_k.split_iters(k, tiling.n_tiles, tiling.block_k, 2, 4, x.device)
            base = tiling.iters
            candidates = [base, old_iters, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
            seen = set()
            for it in candidates:
                if it in seen or it * tiling.block_k > 2 * k or iters_swept >= args.iters_seconds:
                    continue
                seen.add(it)
                started = time.time()
                t_it = gemv.gemv_tiling(x, mods[0].qweight, iters=it)
                if t_it.n_tiles * t_it.arrivals > 40 * 132 and it not in (base, old_iters):
                    continue  # many small programs: the old rule's side is covered

                def swept_iters(mods=mods, x=x, y=y, t_it=t_it) -> None:
                    for mod in mods:
                        gemv.launch_gemv(x, mod.qweight, y, t_it)

                us = timer(swept_iters, calls=4, reps=5) / len(mods) * 1e6
                tag = "default" if it == base else ("old" if it == old_iters else "")
                row["iters_sweep"][str(it)] = {
                    "splits": t_it.arrivals,
                    "programs": t_it.n_tiles * t_it.arrivals,
                    "us": us,
                    "tag": tag,
                }
                iters_swept += time.time() - started
            print(
                f"[{args.label}] {k}x{n} iters sweep: "
                + " ".join(
                    f"i{i}/s{v['splits']}/p{v['programs']}{'*' if v['tag'] else ''}:{v['us']:.2f}"
                    for i, v in row["iters_sweep"].items()
                ),
                flush=True,
            )
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
    registers = gemv_registers()
    print(f"[{args.label}] GEMV kernels' registers/spills: {registers}", flush=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "label": args.label,
                "gpu": "dry" if args.dry else torch.cuda.get_device_name(),
                "read_bandwidth_gb_s": bandwidth / 1e9,
                "all_linears_us": total,
                "gemv_registers": registers,
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
