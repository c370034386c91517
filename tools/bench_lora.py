"""LoRA decode cost on a GPU: decode tok/s with one adapter on every linear against none.

    python tools/bench_lora.py --shape llama3-8b --format exl2 --rank 16

Builds (once, under --work) the random-weight quantized model of tools/bench.py and a
random PEFT adapter of rank --rank on q/k/v/o/gate/up/down of every layer, then on one
engine measures batch-1 decode tok/s (prompt --prompt tokens, 128 new tokens, median of 5
after 2 warm-ups, CUDA graphs on) and prefill tok/s, without the adapter, with it selected
(scale 1.0), and decode again with it loaded but not selected (the no-LoRA path must not
slow down because one is loaded), and aggregate tok/s of --batch concurrent jobs that all
use the adapter against none. LoRA decode is measured twice on the same engine: with its
steps replayed as CUDA graphs (`engine.lora_graphs`, the default) and run eagerly, so one
run shows both slow-downs against the no-LoRA graphs (target: <= 15% at rank 16 on
llama3-8b, for the graph path). Writes JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.engine import Engine, EngineOptions
from tools.bench import (
    NEW_TOKENS,
    SHAPES,
    _linears,
    _median_runs,
    build_model,
    decode_tok_s,
    prefill_tok_s,
)

ROOT = Path(__file__).resolve().parent.parent

MODES = {"graph": True, "eager": False}  # LoRA decode steps: CUDA graphs or eager
ROUNDS = 3


ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(
    path: Path,
    shape_name: str,
    rank: int,
    *,
    seed: int = 1,
    targets: list[str] | None = None,
) -> Path:
    """A random PEFT adapter (safetensors) of `rank` on the `targets` linears of every layer
    (default: all seven); skipped if present."""
    from safetensors.torch import save_file

    if (path / "adapter_config.json").is_file():
        return path
    targets = list(targets or ALL_TARGETS)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, k, n in _linears(SHAPES[shape_name]):
        if name == "lm_head" or name.rsplit(".", 1)[-1] not in targets:
            continue
        key = f"base_model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, k, generator=gen) / k**0.5).half()
        tensors[f"{key}.lora_B.weight"] = (torch.randn(n, rank, generator=gen) * 0.01).half()
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return path


def aggregate_tok_s(engine: Engine, jobs: int, loras: dict[str, float]) -> float:
    vocab = engine.config.vocab_size
    settings = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ban_eos_token": True}

    def run() -> float:
        submitted = [
            engine.scheduler.submit(
                torch.randint(2, vocab, (128,)).tolist(), {**settings, "loras": loras}
            )
            for _ in range(jobs)
        ]
        torch.cuda.synchronize()
        t = time.perf_counter()
        tokens = sum(len(e.token_ids) for e in engine.scheduler.stream_many(submitted))
        return tokens / (time.perf_counter() - t)

    return _median_runs(run, warmups=1, runs=3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    parser.add_argument("--format", default="exl2", choices=["gptq", "exl2"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--work", default="/tmp/kestrel-bench")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import triton

    work = Path(args.work)
    model = build_model(work / f"{args.shape}-{args.format}", args.shape, args.format)
    adapter = build_adapter(work / f"{args.shape}-lora-r{args.rank}", args.shape, args.rank)
    per_job = max(args.prompt, 128) + NEW_TOKENS + 16
    engine = Engine.load(
        model,
        EngineOptions(
            device="cuda",
            dtype="float16",
            max_seq_len=per_job,
            cache_tokens=(args.batch + 1) * (per_job + 256),
            max_batch=max(args.batch, 1),
            prefix_caching=False,
        ),
    )
    prompt = torch.randint(2, engine.config.vocab_size, (args.prompt,)).tolist()
    result: dict = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": args.shape,
        "format": args.format,
        "rank": args.rank,
        "prompt": args.prompt,
        "new_tokens": NEW_TOKENS,
    }
    if engine.graphs is None:
        raise SystemExit("CUDA graphs are off on this engine: nothing to compare against")
    result["decode_tok_s_base"] = decode_tok_s(engine, prompt)
    result["prefill_tok_s_base"] = prefill_tok_s(engine, prompt)
    t = time.perf_counter()
    name = engine.loras.load(adapter, "bench")
    result["lora_load_s"] = time.perf_counter() - t
    result["lora_mib"] = engine.loras.info()[name]["mib"]
    # Base and LoRA decode alternate over ROUNDS rounds and the medians are compared, so a
    # drift of the GPU's clocks during the run does not land on one side (an H200 run gave
    # 300 tok/s for the first base measurement and 325 for the next). Slow-downs are
    # against `base_loaded` (the no-LoRA path with the adapter loaded).
    runs: dict[str, list[float]] = {"base_loaded": [], **{f"lora_{m}": [] for m in MODES}}
    steps = dict.fromkeys(MODES, 0)
    for _ in range(ROUNDS):
        engine.loras.set_default({})
        runs["base_loaded"].append(decode_tok_s(engine, prompt))
        engine.loras.set_default({name: 1.0})
        # Eager LoRA steps are ~20x slower (host-bound): one round of them is enough.
        for mode, graphs in MODES.items() if not runs["lora_eager"] else [("graph", True)]:
            engine.lora_graphs = graphs
            before = engine.graphs.lora_steps
            runs[f"lora_{mode}"].append(decode_tok_s(engine, prompt))
            # Which path the LoRA steps took, so a figure is never credited to the wrong one.
            steps[mode] += engine.graphs.lora_steps - before
    for key, values in runs.items():
        result[f"decode_tok_s_{key}"] = statistics.median(values)
        result[f"decode_tok_s_{key}_runs"] = values
    for mode in MODES:
        result[f"lora_graph_steps_{mode}"] = steps[mode]
        result[f"slowdown_{mode}"] = (
            1 - result[f"decode_tok_s_lora_{mode}"] / result["decode_tok_s_base_loaded"]
        )
    engine.lora_graphs = MODES["graph"]
    result["prefill_tok_s_lora"] = prefill_tok_s(engine, prompt)
    engine.loras.set_default({})
    if args.batch > 1:
        result[f"aggregate_tok_s_{args.batch}_base"] = aggregate_tok_s(engine, args.batch, {})
        # Eager LoRA steps are ~20x slower (host-bound): one round of them is enough.
        for mode, graphs in MODES.items() if not runs["lora_eager"] else [("graph", True)]:
            engine.lora_graphs = graphs
            result[f"aggregate_tok_s_{args.batch}_lora_{mode}"] = aggregate_tok_s(
                engine, args.batch, {name: 1.0}
            )
        engine.lora_graphs = MODES["graph"]
    engine.unload()
    print(json.dumps(result, indent=1))
    print(
        f"{result['gpu']}: {args.shape} {args.format}, rank {args.rank}, P={args.prompt}: "
        f"decode {result['decode_tok_s_base_loaded']:.1f} tok/s without LoRA; with it "
        f"{result['decode_tok_s_lora_graph']:.1f} (graphs, slow-down "
        f"{100 * result['slowdown_graph']:.1f}%, target <= 15%) and "
        f"{result['decode_tok_s_lora_eager']:.1f} (eager, slow-down "
        f"{100 * result['slowdown_eager']:.1f}%)"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
