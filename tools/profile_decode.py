"""Where a decode step spends its time, on a GPU (batch 1, or --batch B sequences).

    python tools/profile_decode.py --shape llama3-8b --format gptq --prompt 512 --out DIR
    python tools/profile_decode.py --batch 64 --prompt 128 --out DIR

Builds (or reuses) tools/bench.py's random-weight model and reports, for one decode step:
  - the step as the scheduler sees it (engine.runner.forward + argmax + host sync), ms;
  - the captured CUDA graph replayed back to back (GPU time per step, no host work), ms;
  - the kernels of one eager forward (torch.profiler): time, count and share per kernel
    name, so the GEMV share and the small-kernel tail can be compared with the roofline;
  - each distinct linear alone at M = B rows of x, replayed in a CUDA graph of 50 calls:
    µs and GB/s (the GEMV at small B, the mid-M tensor-core path above it).
Writes profile.json (and the profiler's table as profile.txt) to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.cache import Sequence
from engine.engine import Engine, EngineOptions
from engine.quantized_linear import QuantizedLinear
from kernels.quant_matmul import quant_matmul
from tools.bench import add_model_arguments, model_from_arguments

ROOT = Path(__file__).resolve().parent.parent


def _read_bandwidth() -> float:
    """Measured device read bandwidth (bytes/s): a sum over 4 GiB, best of 5."""
    x = torch.empty(2**30, dtype=torch.float32, device="cuda").fill_(1.0)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del x
    return 4 * 2**30 / best


def distinct_linears(
    model: torch.nn.Module,
) -> tuple[dict[tuple[int, int], QuantizedLinear], dict[tuple[int, int], int]]:
    """One quantized linear per (in_features, out_features) shape, and how many of each
    shape the model has (what the tuning tools time and weight)."""
    shapes: dict[tuple[int, int], QuantizedLinear] = {}
    counts: dict[tuple[int, int], int] = {}
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear):
            key = (mod.in_features, mod.out_features)
            shapes.setdefault(key, mod)
            counts[key] = counts.get(key, 0) + 1
    return shapes, counts


def kernel_table(prof: torch.profiler.profile, runs: int) -> list[dict]:
    """Device kernels of a profile over `runs` runs: µs and launches per run, largest first."""
    kernels = []
    for evt in prof.key_averages():
        dev_us = getattr(evt, "device_time_total", 0.0) or getattr(evt, "cuda_time_total", 0.0)
        if evt.device_type == torch.autograd.DeviceType.CUDA and dev_us > 0:
            kernels.append({"name": evt.key[:90], "us": dev_us / runs, "count": evt.count / runs})
    kernels.sort(key=lambda k: -k["us"])
    return kernels


def _graph_time(fn, calls: int = 50, reps: int = 5) -> float:
    """Seconds per call of fn() replayed in a CUDA graph of `calls` calls (best of reps)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--cache-type", default="fp16", help="KV cache storage: fp16 fp8 q8 q6 q4")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    args = parser.parse_args()
    B = args.batch
    path, out = model_from_arguments(args)
    engine = Engine.load(
        path,
        EngineOptions(
            device="cuda",
            dtype="float16",
            max_seq_len=args.prompt + 256,
            cache_type=args.cache_type,
            cache_tokens=B * (args.prompt + 512),
            max_batch=max(B, 1),
        ),
    )
    bandwidth = _read_bandwidth()
    # Bytes one decode step must read: every linear's storage, the norms, one embedding row.
    weight_bytes = sum(
        m.storage_bits // 8 for m in engine.model.modules() if isinstance(m, QuantizedLinear)
    ) + sum(
        p.numel() * p.element_size() for n, p in engine.model.named_parameters() if "embed" not in n
    )
    vocab = engine.config.vocab_size
    seqs = [Sequence() for _ in range(B)]
    prompts = [torch.randint(2, vocab, (args.prompt,)).tolist() for _ in seqs]
    tokens = [
        int(engine.runner.prefill(seq, prompt)[-1].argmax())
        for seq, prompt in zip(seqs, prompts, strict=True)
    ]

    def step() -> list[int]:
        return engine.runner.forward(seqs, [[t] for t in tokens]).argmax(-1).tolist()

    # 1. The step as the engine loop runs it (forward, argmax, host sync).
    for _ in range(5):
        tokens = step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    steps = 64
    for _ in range(steps):
        tokens = step()
    step_ms = (time.perf_counter() - t) / steps * 1e3

    # 2. The graph alone, back to back.
    graph = None
    if engine.graphs is not None:
        graph = engine.graphs._graphs[(engine.graphs.bucket(B), 1)].graph
    replay_ms = None
    if graph is not None:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - t) / steps * 1e3

    # 3. Kernels of eager forwards (the graph replays the same kernels).
    from engine.cache import ForwardBatch

    def eager_step() -> None:
        for seq in seqs:
            seq.reserve(engine.cache, seq.length + 1)
        batch = ForwardBatch.build(engine.cache, seqs, [[t] for t in tokens])
        engine.model(batch, engine.cache)

    eager_step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            eager_step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    (out / "profile.txt").write_text(table)
    kernels = kernel_table(prof, 3)
    total_us = sum(k["us"] for k in kernels)

    # 4. Each distinct linear alone.
    linears = []
    seen = set()
    for name, mod in engine.model.named_modules():
        if not isinstance(mod, QuantizedLinear):
            continue
        key = (mod.in_features, mod.out_features)
        if key in seen:
            continue
        seen.add(key)
        x = torch.randn(B, mod.in_features, device="cuda", dtype=torch.float16)
        secs = _graph_time(lambda mod=mod, x=x: quant_matmul(x, mod.qweight))
        nbytes = mod.storage_bits // 8
        linears.append(
            {
                "name": name,
                "k": key[0],
                "n": key[1],
                "us": secs * 1e6,
                "bytes": nbytes,
                "gb_s": nbytes / secs / 1e9,
                "fraction_of_bw": nbytes / secs / bandwidth,
            }
        )
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": args.shape,
        "format": args.format,
        "prompt": args.prompt,
        "batch": B,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes": weight_bytes,
        "roofline_tok_s": bandwidth / weight_bytes,
        "step_ms": step_ms,
        "graph_replay_ms": replay_ms,
        "eager_kernel_us_per_step": total_us,
        # Launches of one eager step, every kernel name (issue 28's target counts them).
        "kernels_per_step": sum(k["count"] for k in kernels),
        "kernels": kernels[:40],
        "linears": linears,
    }
    (out / "profile.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("kernels",)}, indent=1))
    for k in kernels[:25]:
        print(f"{k['us']:9.1f} us  x{k['count']:6.0f}  {k['name']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
