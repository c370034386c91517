"""Multi-GPU check on a 2-GPU machine: one GPU, layer split and tensor parallel on the same
random-weight model; greedy tokens compared between them, decode/prefill tok/s for each.

    python tools/multigpu_check.py --shape llama3-70b --format gptq --modes single split tp \
        --work /tmp/kestrel-mgpu --out bench/results/multigpu

Builds the model with tools/bench.py's builder (random codes, realistic scales) once under
--work. Modes:
  single    everything on cuda:0 (an out-of-memory error is recorded if it does not fit)
  split     layer split: gpu_split gives cuda:0 half the model's footprint, cuda:1 the rest;
            decode replays one CUDA graph segment per GPU (engine/cuda_graph.py)
  split_eager  the same split without CUDA graphs (every step launched from Python)
  autosplit layer split from measured free memory (fills cuda:0 first)
  tp        tensor parallel over 2 GPUs (NCCL, decode as CUDA graphs)
  tp_eager  the same without CUDA graphs
  tp4       tensor parallel over 4 GPUs (a 4-GPU machine), decode as CUDA graphs
Per mode: decode tok/s at batch 1 (prompt --prompt, 128 new tokens, median of 5 after 2
warm-ups, as tools/bench.py) two ways (`DECODE_LOOPS`): `decode_tok_s` through the
scheduler as a server decodes (lookahead, tokens kept on the device) and
`decode_sync_tok_s` by a hand loop that reads every token back; prefill tok/s, load time,
memory in use per GPU, and the greedy continuation (--greedy tokens) of a fixed prompt.
Each mode writes <out>/<shape>-<format>-<mode>.json; every run rewrites
<out>/<shape>-<format>-summary.json from all mode files present, with the greedy tokens of
each mode compared against `single` (or the first mode present). Modes can run in
separate invocations (each must stay under a time
limit); the model under --work is reused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.cache import Sequence
from engine.config import ModelConfig
from engine.engine import Engine, EngineOptions
from engine.held_bytes import held_bytes
from engine.placement import GIB, PlacementError
from engine.placement.footprint import model_footprint
from engine.weights import WeightStore
from tools.bench import SHAPES, build_model, scheduler_decode_tok_s

ROOT = Path(__file__).resolve().parent.parent

MODES = ("single", "split", "split_eager", "autosplit", "tp", "tp_eager", "tp4")
# Ranks of each tensor-parallel mode.
TP_WORLD = {"tp": 2, "tp_eager": 2, "tp4": 4}
NEW_TOKENS = 128
DECODE_LOOPS = {
    "decode_tok_s": "one greedy job through engine.scheduler, as a server runs it "
    "(lookahead: one decode step in flight, its token fed on the device), first token to last",
    "decode_sync_tok_s": "runner.forward + argmax + int() per step (a host read of every "
    "token before the next step is launched)",
}


def _used_gib() -> dict[str, float]:
    used = {}
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        used[f"cuda:{i}"] = round((total - free) / GIB, 3)
    return used


def _gpus(engine: Engine) -> list[torch.device]:
    return [d for d in engine.devices if d.type == "cuda"]


def _held(engine: Engine) -> dict[str, int]:
    held = held_bytes(engine.model, engine.cache)
    held["torch_allocated"] = sum(torch.cuda.memory_allocated(d) for d in _gpus(engine))
    held["torch_reserved"] = sum(torch.cuda.memory_reserved(d) for d in _gpus(engine))
    return held


def _options(max_seq_len: int, **extra) -> EngineOptions:
    return EngineOptions(dtype="float16", max_seq_len=max_seq_len, **extra)


def _half_split(path: Path, max_seq_len: int) -> list[float]:
    """gpu_split that gives cuda:0 half of the model's footprint and cuda:1 the rest."""
    fp = model_footprint(
        WeightStore(path),
        ModelConfig.from_dir(path),
        dtype=torch.float16,
        cache_tokens=max_seq_len,
        page_size=256,
        prefill_chunk=2048,
    )
    return [round(fp.total_bytes / 2 / GIB, 2), round(fp.total_bytes / GIB, 2)]


def load_engine(mode: str, path: Path, max_seq_len: int) -> Engine:
    if mode == "single":
        return Engine.load(path, _options(max_seq_len, device="cuda:0"))
    if mode in ("split", "split_eager"):
        split = _half_split(path, max_seq_len)
        graphs = mode == "split"
        return Engine.load(
            path,
            _options(max_seq_len, gpu_split=split, cuda_graphs=graphs, split_cuda_graphs=graphs),
        )
    if mode == "autosplit":
        return Engine.load(path, _options(max_seq_len, autosplit=True))
    from engine.tensor_parallel.launch import launch_tensor_parallel

    graphs = mode != "tp_eager"
    return launch_tensor_parallel(path, _options(max_seq_len, cuda_graphs=graphs), TP_WORLD[mode])


def _sync() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def measure(engine: Engine, prompt: list[int], greedy_prompt: list[int], greedy: int) -> dict:
    def prefill() -> float:
        seq = Sequence()
        _sync()
        t = time.perf_counter()
        engine.runner.prefill(seq, prompt)
        _sync()
        seq.release(engine.cache)
        return len(prompt) / (time.perf_counter() - t)

    def decode() -> float:
        seq = Sequence()
        token = int(engine.runner.prefill(seq, prompt)[-1].argmax())
        _sync()
        t = time.perf_counter()
        for _ in range(NEW_TOKENS):
            token = int(engine.runner.forward([seq], [[token]])[-1].argmax())
        elapsed = time.perf_counter() - t
        seq.release(engine.cache)
        return NEW_TOKENS / elapsed

    def median(run) -> float:
        for _ in range(2):
            run()
        return statistics.median(run() for _ in range(5))

    seq = Sequence()
    logits = engine.runner.prefill(seq, greedy_prompt)[-1]
    finite = bool(torch.isfinite(logits).all())
    tokens: list[int] = []
    top2: list[list[float]] = []
    for step in range(greedy):
        if step:
            logits = engine.runner.forward([seq], [[tokens[-1]]])[-1]
        values, ids = logits.float().topk(2)
        tokens.append(int(ids[0]))
        top2.append([round(float(v), 5) for v in values])
    seq.release(engine.cache)
    return {
        "greedy_tokens": tokens,
        # The two highest logits of each greedy step: how close a step was to a tie, and
        # how far two modes' logits drift apart before they part (summarize).
        "greedy_top2": top2,
        "greedy_logits_finite": finite,
        # The serving path: one job through the scheduler (tools/bench.py's), lookahead.
        "decode_tok_s": scheduler_decode_tok_s(engine, prompt),
        "decode_sync_tok_s": median(decode),
        "decode_loops": DECODE_LOOPS,
        "prefill_tok_s": median(prefill),
    }


def run_mode(mode: str, path: Path, args: argparse.Namespace) -> dict:
    vocab = SHAPES[args.shape]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, vocab, (args.prompt,), generator=gen).tolist()
    greedy_prompt = torch.randint(2, vocab, (64,), generator=gen).tolist()
    max_seq_len = args.prompt + NEW_TOKENS + args.greedy + 64
    torch.cuda.empty_cache()
    before = _used_gib()
    t0 = time.perf_counter()
    try:
        engine = load_engine(mode, path, max_seq_len)
    except PlacementError as e:
        return {"mode": mode, "skipped": str(e)}
    load_s = time.perf_counter() - t0
    after = _used_gib()
    result = {
        "mode": mode,
        "load_s": round(load_s, 1),
        "gpu_mem_used_gib": {d: round(after[d] - before[d], 3) for d in after},
        "placement": engine.placement.describe() if engine.placement is not None else None,
        "tp_world_size": engine.tp_world_size,
        "cuda_graphs": engine.graphs is not None,
        # Bytes held by part (engine.held_bytes) and torch's allocated/reserved: per rank
        # under tensor parallelism, else this process's (issue 33's memory accounting).
        "held_bytes": engine.rank_memory or [_held(engine)],
        # Devices of the graph segments replayed per decode step (one per GPU of a split).
        "graph_segments": (
            [str(s.device) for s in engine.graphs.segments] if engine.graphs is not None else []
        ),
    }
    try:
        result.update(measure(engine, prompt, greedy_prompt, args.greedy))
    except BaseException:
        # Other TP ranks may be stuck in a collective: no graceful stop.
        (engine.abort if engine.tp_world_size > 1 else engine.unload)()
        raise
    engine.unload()
    return result


def _drift(base: dict, run: dict, diverge: int | None) -> dict:
    """Whether a mode that parts from the base's greedy tokens does so at a near tie: the
    base's top-1 minus top-2 logit at the parting step, against the largest difference of the
    two runs' top logit over the steps before it (their numeric drift, the same tokens fed).
    A margin within a few times the drift is rounding (summation order), not a wrong sum."""
    if "greedy_top2" not in base or "greedy_top2" not in run:
        return {}
    steps = len(base["greedy_top2"]) if diverge is None else diverge
    pairs = zip(base["greedy_top2"][:steps], run["greedy_top2"][:steps], strict=False)
    drift = max((abs(a[0] - b[0]) for a, b in pairs), default=0.0)
    result = {"max_top1_drift_before": round(drift, 5)}
    if diverge is not None:
        top1, top2 = base["greedy_top2"][diverge]
        result["base_margin_at_divergence"] = round(top1 - top2, 5)
    return result


def summarize(out: Path, prefix: str) -> dict:
    runs = {}
    for mode in MODES:
        file = out / f"{prefix}-{mode}.json"
        if file.is_file():
            runs[mode] = json.loads(file.read_text())
    measured = {m: r for m, r in runs.items() if "greedy_tokens" in r}
    base_mode = "single" if "single" in measured else next(iter(measured), None)
    compare = {}
    if base_mode is not None:
        base = measured[base_mode]["greedy_tokens"]
        for mode, r in measured.items():
            tokens = r["greedy_tokens"]
            diverge = next(
                (i for i, (a, b) in enumerate(zip(base, tokens, strict=False)) if a != b), None
            )
            compare[mode] = {"identical": tokens == base, "first_divergence": diverge}
            compare[mode].update(_drift(measured[base_mode], r, diverge))
    single = measured.get("single", {}).get("decode_tok_s")
    speed = {
        m: {
            "decode_tok_s": round(r["decode_tok_s"], 1),
            "decode_sync_tok_s": round(r.get("decode_sync_tok_s", 0.0), 1),
            "prefill_tok_s": round(r["prefill_tok_s"]),
            "vs_single": round(r["decode_tok_s"] / single, 2) if single else None,
        }
        for m, r in measured.items()
    }
    return {"model": prefix, "greedy_vs": base_mode, "greedy": compare, "speed": speed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama3-70b", choices=list(SHAPES))
    parser.add_argument("--format", default="gptq", choices=["gptq", "exl2"])
    parser.add_argument(
        "--modes",
        nargs="*",
        default=["single", "split", "tp"],
        choices=MODES,
        help="none: build only",
    )
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens for tok/s")
    parser.add_argument("--greedy", type=int, default=32, help="greedy tokens compared")
    parser.add_argument("--work", default="/tmp/kestrel-mgpu")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "multigpu"))
    args = parser.parse_args()
    need = max([2, *(TP_WORLD.get(m, 2) for m in args.modes)])
    if torch.cuda.device_count() < need:
        print(f"modes {args.modes} need {need} CUDA GPUs", file=sys.stderr)
        return 1
    import triton

    path = build_model(Path(args.work) / f"{args.shape}-{args.format}", args.shape, args.format)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = f"{args.shape}-{args.format}"
    env = {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": args.shape,
        "format": args.format,
        "prompt": args.prompt,
        "new_tokens": NEW_TOKENS,
    }
    for mode in args.modes:
        try:
            result = run_mode(mode, path, args)
        except Exception as e:  # one mode failing must not lose the others' numbers
            result = {"mode": mode, "error": f"{type(e).__name__}: {e}"}
        result.update(env)
        (out / f"{prefix}-{mode}.json").write_text(json.dumps(result, indent=1))
        brief = {
            k: v
            for k, v in result.items()
            if k not in ("greedy_tokens", "greedy_top2") and k not in env
        }
        print(json.dumps(brief), flush=True)
    summary = summarize(out, prefix)
    summary.update(env)
    (out / f"{prefix}-summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
