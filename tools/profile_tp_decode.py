"""Where a tensor-parallel decode step spends its time, against one GPU's (batch 1).

    python tools/profile_tp_decode.py --shape llama3-70b --layers 8 --modes single tp \
        --prompt 512 --steps 32 --work /tmp/kestrel-prof --out DIR

Builds (or reuses) tools/bench.py's random-weight model with `--layers` decoder layers (a
70B shape of 8 layers builds and loads in seconds; per layer it is the 70B model), loads it
on one GPU (`single`) and with tensor parallelism over 2 GPUs (`tp`: NCCL, decode CUDA
graphs) or 4 (`tp4`, a 4-GPU machine), prefills --prompt tokens and times --steps greedy
decode steps two ways (`LOOPS`): through the scheduler as a server runs them (lookahead: one
step in flight, tokens kept on the device; `tok_s`) and by hand (runner.forward + argmax + a
host read each step; `sync_tok_s`). Then the --loop's steps (default: the scheduler's) run
under torch.profiler on rank 0 (this process; the other ranks run in their own spawned
processes and are not traced: their lateness shows on rank 0 as all-reduce time, since a
one-shot all-reduce waits for every peer inside its kernel). Per mode it writes the chrome
trace and reports, per token:
  - each kernel family (GEMV, all-reduce, norm, RoPE, attention, copy/cast, elementwise,
    memcpy, other): µs and kernel count, with the largest kernels of each family;
  - the GPU's idle time between kernels (the decode window less the union of the kernels'
    intervals) and the largest gaps with the kernels around them;
  - the host's CUDA calls: graph launches, kernel launches outside graphs and the calls
    that wait for the GPU (stream/device/event synchronize, blocking copies), i.e. whether a
    step is one graph replay.
Writes <out>/tp_profile-<shape>-L<layers>-<mode>.json (+ .trace.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

# Kernel families, first match wins (lower-cased kernel names).
FAMILIES: tuple[tuple[str, str], ...] = (
    ("all_reduce", r"one_shot|two_shot|all_?reduce|nccl|multimem|symm_mem|allgather|all_gather"),
    # kernels/attention: _decode_kernel, _prefill_kernel; kernels/kv_quant: _kv_write_kernel
    ("attention", r"attn|attention|flash|paged|_decode_kernel|_prefill_kernel|kv_write"),
    ("rope", r"rope|rotary"),
    ("norm", r"rms|norm"),
    ("gemv", r"quant|gemv|slot_sum|matmul|gemm|splitk|split_k|cutlass|xmma|_mm_|dot"),
    ("copy_cast", r"copy|cast|convert|to_copy"),
    ("elementwise", r"elementwise|vectorized|silu|mul|add|fill|where|index|embedding"),
    ("sampling", r"argmax|reduce|softmax|topk|max"),
)
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# The decode loops timed (both) and profiled (--loop).
LOOPS = {
    "scheduler": "one greedy job through engine.scheduler (the serving path): lookahead, "
    "one decode step in flight, its token fed on the device",
    "sync": "runner.forward + argmax + int() per step: a host read of every token before "
    "the next step is launched",
}
WAITS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
)


def family(name: str, cat: str) -> str:
    if cat != "kernel":
        return "memcpy"
    low = name.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, low):
            return fam
    return "other"


def _union(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return busy


def analyze(events: Iterable[dict[str, Any]], steps: int, top: int = 5) -> dict[str, Any]:
    """Per-token kernel families, idle GPU time and host calls of a chrome trace's events
    (torch.profiler's export: ts and dur in µs) covering `steps` decode steps."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    host = [
        e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
    ]
    device.sort(key=lambda e: e["ts"])
    fams: dict[str, dict[str, Any]] = {}
    for e in device:
        f = fams.setdefault(family(e["name"], e["cat"]), {"us": 0.0, "count": 0, "kernels": {}})
        f["us"] += e["dur"]
        f["count"] += 1
        f["kernels"][e["name"]] = f["kernels"].get(e["name"], 0.0) + e["dur"]
    table = {}
    for name, f in sorted(fams.items(), key=lambda kv: -kv[1]["us"]):
        largest = sorted(f["kernels"].items(), key=lambda kv: -kv[1])[:top]
        table[name] = {
            "us_per_token": round(f["us"] / steps, 2),
            "count_per_token": round(f["count"] / steps, 2),
            "largest": [(k[:120], round(v / steps, 2)) for k, v in largest],
        }
    gaps = []
    if device:
        start = device[0]["ts"]
        stop = max(e["ts"] + e["dur"] for e in device)
        busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in device])
        end = device[0]["ts"] + device[0]["dur"]
        for prev, nxt in zip(device, device[1:], strict=False):
            end = max(end, prev["ts"] + prev["dur"])
            if nxt["ts"] > end:
                gaps.append((nxt["ts"] - end, prev["name"][:60], nxt["name"][:60]))
        gaps.sort(reverse=True)
    else:
        start = stop = busy = 0.0
    calls: dict[str, int] = {}
    for e in host:
        calls[e["name"]] = calls.get(e["name"], 0) + 1
    per_step = {k: round(v / steps, 2) for k, v in sorted(calls.items(), key=lambda kv: -kv[1])}
    return {
        "steps": steps,
        "window_us_per_token": round((stop - start) / steps, 2),
        "busy_us_per_token": round(busy / steps, 2),
        "idle_us_per_token": round((stop - start - busy) / steps, 2),
        "largest_gaps_us": [(round(g, 1), a, b) for g, a, b in gaps[:top]],
        "families": table,
        "host_calls_per_step": per_step,
        "graph_launches_per_step": per_step.get("cudaGraphLaunch", 0.0),
        "kernel_launches_per_step": round(
            sum(
                v
                for k, v in per_step.items()
                if k
                in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
            ),
            2,
        ),
        "host_waits_per_step": round(sum(v for k, v in per_step.items() if k.startswith(WAITS)), 2),
    }


def _format(mode: str, result: dict[str, Any]) -> str:
    a = result["profile"]
    lines = [
        f"== {mode}: {result['tok_s']:.1f} tok/s unprofiled through the scheduler "
        f"({1e6 / result['tok_s']:.0f} µs/token), {result['sync_tok_s']:.1f} by the hand "
        f"loop; load {result['load_s']:.1f} s; profiled: the {result['profiled_loop']} loop",
        "   torch allocated/reserved GB per rank: "
        + ", ".join(
            f"{m.get('torch_allocated', 0) / 1e9:.2f}/{m.get('torch_reserved', 0) / 1e9:.2f}"
            for m in result["rank_memory"]
        ),
        f"   GPU window {a['window_us_per_token']:.0f} µs/token: "
        f"busy {a['busy_us_per_token']:.0f}, idle {a['idle_us_per_token']:.0f}",
        f"   per step: {a['graph_launches_per_step']} graph launches, "
        f"{a['kernel_launches_per_step']} kernel launches outside graphs, "
        f"{a['host_waits_per_step']} host waits",
        f"   {'family':<12} {'µs/token':>10} {'kernels/token':>14}",
    ]
    for name, f in a["families"].items():
        lines.append(f"   {name:<12} {f['us_per_token']:>10.1f} {f['count_per_token']:>14.1f}")
    lines.append(f"   largest gaps (µs, after, before): {a['largest_gaps_us'][:3]}")
    return "\n".join(lines)


def _sync() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def run_mode(mode: str, path: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from engine.cache import Sequence
    from tools.multigpu_check import load_engine

    max_seq_len = args.prompt + 4 * args.steps + 256
    t0 = time.perf_counter()
    engine = load_engine(mode, path, max_seq_len)
    _sync()
    load_s = time.perf_counter() - t0
    # Per rank: held bytes by part and torch's allocated/reserved (reserved well above
    # allocated: what the staging pool left fragmented, now that the pieces are the shards).
    memory = (
        engine.rank_memory
        if engine.tp_world_size > 1
        else [
            {
                "torch_allocated": torch.cuda.memory_allocated(0),
                "torch_reserved": torch.cuda.memory_reserved(0),
            }
        ]
    )
    try:
        prompt = torch.randint(10, 1000, (args.prompt,), generator=torch.Generator().manual_seed(0))
        seq = Sequence()
        token = int(engine.runner.prefill(seq, prompt.tolist())[-1].argmax())

        def decode(n: int) -> float:
            nonlocal token
            _sync()
            t = time.perf_counter()
            for _ in range(n):
                token = int(engine.runner.forward([seq], [[token]])[-1].argmax())
            return n / (time.perf_counter() - t)

        decode(8)  # captures the decode graph (every rank in step)
        sync_tok_s = statistics.median(decode(args.steps) for _ in range(3))
        seq.release(engine.cache)
        tok_s = statistics.median(
            scheduler_decode(engine, prompt.tolist(), args.steps) for _ in range(3)
        )
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        if args.loop == "scheduler":
            scheduler_decode(engine, prompt.tolist(), args.steps, prof)
        else:
            seq = Sequence()
            token = int(engine.runner.prefill(seq, prompt.tolist())[-1].argmax())
            prof.start()
            decode(args.steps)
            _sync()
            prof.stop()
            seq.release(engine.cache)
        trace = out / f"tp_profile-{args.shape}-L{args.layers}-{mode}.trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    finally:
        (engine.abort if engine.tp_world_size > 1 else engine.unload)()
    return {
        "mode": mode,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "load_s": round(load_s, 2),
        "rank_memory": memory,
        # tok_s: the serving path (LOOPS["scheduler"]); sync_tok_s: the hand loop.
        "tok_s": tok_s,
        "sync_tok_s": sync_tok_s,
        "loops": LOOPS,
        "profiled_loop": args.loop,
        "profile": analyze(events, args.steps),
    }


def scheduler_decode(
    engine: Any, prompt: list[int], steps: int, profiler: Any | None = None
) -> float:
    """Decode tok/s of one greedy job of `steps` + 1 tokens through the scheduler, from its
    first token's event to its last (as tools/bench.py's scheduler_decode_tok_s): the
    lookahead keeps one decode step in flight, fed its token on the device. `profiler`
    (torch.profiler) is started at the first token and stopped after the last."""
    settings = {"max_new_tokens": steps + 1, "temperature": 0, "ban_eos_token": True}
    job = engine.scheduler.submit(prompt, settings)
    first = None
    tokens = 0
    for event in engine.scheduler.stream_many([job]):
        if not event.token_ids:
            continue
        if first is None:
            if profiler is not None:
                profiler.start()
            first = time.perf_counter()
            tokens -= len(event.token_ids)
        tokens += len(event.token_ids)
    _sync()
    assert first is not None and tokens > 0, "the job produced no tokens after its first"
    elapsed = time.perf_counter() - first
    if profiler is not None:
        profiler.stop()
    return tokens / elapsed


def main() -> None:
    from tools.bench import build_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-70b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--format", default="gptq", choices=["gptq", "exl2"])
    p.add_argument(
        "--modes", nargs="+", default=["single", "tp"], choices=["single", "tp", "tp_eager", "tp4"]
    )
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument(
        "--loop",
        default="scheduler",
        choices=list(LOOPS),
        help="the decode loop profiled (both are timed)",
    )
    p.add_argument("--work", default="/tmp/kestrel-prof")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = Path(args.work) / f"{args.shape}-L{args.layers}-{args.format}"
    t = time.perf_counter()
    build_model(path, args.shape, args.format, layers=args.layers)
    print(f"model {path} ready in {time.perf_counter() - t:.1f} s", flush=True)
    for mode in args.modes:
        result = run_mode(mode, path, args, out)
        name = out / f"tp_profile-{args.shape}-L{args.layers}-{mode}.json"
        name.write_text(json.dumps(result, indent=1))
        print(_format(mode, result), flush=True)


if __name__ == "__main__":
    main()
