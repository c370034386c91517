"""Where a prompt's prefill spends its time, on a GPU.

    python tools/profile_prefill.py --shape llama3-8b --format gptq --prompts 512 2048 --out DIR
    python tools/profile_prefill.py --shape llama3-8b --mode tp --prompts 512 --out DIR

Builds (or reuses) tools/bench.py's random-weight model, loads it on one GPU or (`--mode tp`,
`tp4`) with tensor parallelism over 2 or 4 (as tools/multigpu_check.py loads it; rank 0 runs
in this process and is the one profiled: the other ranks' lateness shows in its all-reduces)
and reports, per prompt length:
  - prefill tokens/s (engine.runner.prefill, median of 5, as tools/bench.py measures it);
  - the kernels of one prefill (torch.profiler): time, count and share per kernel name;
  - the quantized linears' two parts on their own, summed over the model (rank 0's shard
    under TP): dequantizing
    every weight to fp16 (`dequantize_triton`) and the fp16 matmuls at M = prompt rows,
    so the fixed per-chunk cost of dequantization can be told from the matmul work.
Writes prefill.json (prefill-tp.json, ...; each profiler table as prefill[-tp]-P.txt) to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.cache import Sequence
from engine.engine import Engine, EngineOptions
from engine.quantized_linear import QuantizedLinear
from kernels.quant_matmul import dequantize_triton
from tools.bench import add_model_arguments, model_from_arguments
from tools.multigpu_check import TP_WORLD, load_engine
from tools.profile_decode import kernel_table

ROOT = Path(__file__).resolve().parent.parent


def _cuda_seconds(fn: Callable[[], object], reps: int = 5) -> float:
    """Median wall seconds of fn() between two device syncs."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def linear_parts(model: torch.nn.Module, rows: int) -> dict[str, float]:
    """Milliseconds, summed over the model's quantized linears, of dequantizing each weight
    and of the fp16 matmul x [rows, k] @ W (the two halves of the prefill path)."""
    dequant_s = 0.0
    matmul_s = 0.0
    for mod in model.modules():
        if not isinstance(mod, QuantizedLinear):
            continue
        qw = mod.qweight
        dequant_s += _cuda_seconds(partial(dequantize_triton, qw, dtype=torch.float16))
        w = dequantize_triton(qw, dtype=torch.float16)
        x = torch.randn(rows, mod.in_features, device="cuda", dtype=torch.float16)
        matmul_s += _cuda_seconds(partial(torch.matmul, x, w))
        del w, x
    return {"dequantize_ms": dequant_s * 1e3, "fp16_matmul_ms": matmul_s * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument(
        "--mode",
        default="single",
        choices=["single", *TP_WORLD],
        help="one GPU, or tensor parallel (tools/multigpu_check.py's modes: tp and tp_eager "
        "over 2 GPUs, tp4 over 4)",
    )
    args = parser.parse_args()
    need = TP_WORLD.get(args.mode, 1)
    if torch.cuda.device_count() < need:
        parser.error(f"--mode {args.mode} needs {need} CUDA GPU(s)")
    path, out = model_from_arguments(args)
    max_seq_len = max(args.prompts) + 16
    if args.mode == "single":
        engine = Engine.load(
            path, EngineOptions(device="cuda", dtype="float16", max_seq_len=max_seq_len)
        )
    else:
        engine = load_engine(args.mode, path, max_seq_len)
    suffix = "" if args.mode == "single" else f"-{args.mode}"
    try:
        results = _profile_prompts(engine, args.prompts, out, suffix)
    finally:
        if engine.tp_world_size > 1:
            engine.abort()  # the rank processes
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": args.shape,
        "format": args.format,
        "mode": args.mode,
        "prefill_chunk": engine.options.prefill_chunk,
        "prompts": results,
    }
    (out / f"prefill{suffix}.json").write_text(json.dumps(info, indent=1))
    return 0


def _profile_prompts(
    engine: Engine, prompts: list[int], out: Path, suffix: str
) -> list[dict[str, Any]]:
    """Per prompt length: prefill time, the profiled kernels (written as
    prefill<suffix>-<length>.txt) and the linears' two parts."""
    vocab = engine.config.vocab_size
    results = []
    for prompt_len in prompts:
        prompt = torch.randint(2, vocab, (prompt_len,)).tolist()

        def run(prompt: list[int] = prompt) -> None:
            seq = Sequence()
            engine.runner.prefill(seq, prompt)
            seq.release(engine.cache)

        run()  # compiles this chunk size's kernels
        seconds = _cuda_seconds(run)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(2):
                run()
            torch.cuda.synchronize()
        (out / f"prefill{suffix}-{prompt_len}.txt").write_text(
            prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
        )
        kernels = kernel_table(prof, 2)
        chunk = min(prompt_len, engine.options.prefill_chunk)
        entry = {
            "prompt": prompt_len,
            "prefill_ms": seconds * 1e3,
            "prefill_tok_s": prompt_len / seconds,
            "kernel_us": sum(k["us"] for k in kernels),
            "linear_parts_per_chunk": linear_parts(engine.model, chunk),
            "kernels": kernels[:30],
        }
        results.append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "kernels"}), flush=True)
        for k in kernels[:15]:
            print(f"{k['us']:10.1f} us  x{k['count']:6.0f}  {k['name']}", flush=True)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
