"""Where a prompt's prefill spends its time, on a GPU.

    python tools/profile_prefill.py --shape llama3-8b --format gptq --prompts 512 2048 --out DIR

Builds (or reuses) tools/bench.py's random-weight model and reports, per prompt length:
  - prefill tokens/s (engine.runner.prefill, median of 5, as tools/bench.py measures it);
  - the kernels of one prefill (torch.profiler): time, count and share per kernel name;
  - the quantized linears' two parts on their own, summed over the model: dequantizing
    every weight to fp16 (`dequantize_triton`) and the fp16 matmuls at M = prompt rows,
    so the fixed per-chunk cost of dequantization can be told from the matmul work.
Writes prefill.json (and each profiler table as prefill-P.txt) to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.cache import Sequence  # noqa: E402
from engine.engine import Engine, EngineOptions  # noqa: E402
from engine.quantized_linear import QuantizedLinear  # noqa: E402
from kernels.quant_matmul import dequantize_triton  # noqa: E402
from tools.bench import add_model_arguments, model_from_arguments  # noqa: E402
from tools.profile_decode import kernel_table  # noqa: E402


def _cuda_seconds(fn, reps: int = 5) -> float:
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
        dequant_s += _cuda_seconds(lambda qw=qw: dequantize_triton(qw, dtype=torch.float16))
        w = dequantize_triton(qw, dtype=torch.float16)
        x = torch.randn(rows, mod.in_features, device="cuda", dtype=torch.float16)
        matmul_s += _cuda_seconds(lambda x=x, w=w: x @ w)
        del w, x
    return {"dequantize_ms": dequant_s * 1e3, "fp16_matmul_ms": matmul_s * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    args = parser.parse_args()
    path, out = model_from_arguments(args)
    engine = Engine.load(
        path, EngineOptions(device="cuda", dtype="float16", max_seq_len=max(args.prompts) + 16)
    )
    vocab = engine.config.vocab_size
    results = []
    for prompt_len in args.prompts:
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
        (out / f"prefill-{prompt_len}.txt").write_text(
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
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": args.shape,
        "format": args.format,
        "prefill_chunk": engine.options.prefill_chunk,
        "prompts": results,
    }
    (out / "prefill.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
