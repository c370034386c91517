"""Speculative decoding speed-up on a GPU: plain decode against a draft model and n-gram
(prompt lookup) drafting, on a random-weight model of a real shape, through the scheduler.

    python tools/bench_speculative.py --shape llama3-8b --draft-layers 4 \
        --num-draft-tokens 4 --json bench/results/speculative.json

Random weights make a draft model's acceptance meaningless: two unrelated random models
agree on nothing. So the target is built so that a smaller model predicts it exactly:
the target is the 4-bit GPTQ random model of --shape (tools/bench.py) with the output
projections (o_proj, down_proj) of every layer from --draft-layers on given zero scales.
Those layers still read all their weights and run every kernel, so the target costs what
a full model costs, but they add nothing to the residual stream: the target computes the
same function as its first --draft-layers layers. The draft model is exactly those layers
(same embeddings, norm and head), a real smaller model of the same vocabulary. Acceptance
is then ~100% (floating-point differences between the verify and decode kernels can flip
a near-tie), so the draft number is the speed-up of the mechanism at full acceptance for
a draft of that relative size; real speed-ups scale with real acceptance rates.

N-gram drafting needs text that repeats: its prompt is a random block of 64 tokens
repeated to --prompt tokens, and its acceptance is what the model makes of it (a random
model tends to fall into loops, which prompt lookup then predicts).

Measured for each mode: generated tok/s of one greedy job (median of 3 after a warm-up),
acceptance rate and tokens per verify step (scheduler stats), and whether the output is
token-identical to plain decoding; with --concurrency N also the aggregate tok/s of N
jobs. GPU name, torch and Triton versions go into the JSON with the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.engine import Engine, EngineOptions
from tools.bench import SHAPES, build_model

ROOT = Path(__file__).resolve().parent.parent

# The projections whose output is added to the residual stream: zero them and a layer
# passes its input through (GPTQ: zero scales; FP16: zero weights).
ZEROED = ("self_attn.o_proj", "mlp.down_proj")


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def make_passthrough_pair(target: Path, draft: Path, draft_layers: int) -> None:
    """Make layers >= draft_layers of the model in `target` pass-through (in place) and
    write their exact draft, the first draft_layers layers, to `draft`."""
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    if not 0 < draft_layers < config["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers must be in [1, {config['num_hidden_layers'] - 1}]")
    draft.mkdir(parents=True, exist_ok=True)
    draft_index = {}
    for file in sorted(target.glob("*.safetensors")):
        tensors = load_file(file)
        for name in tensors:
            layer = _layer(name)
            leaf = name.rsplit(".", 1)
            if layer is not None and layer >= draft_layers and leaf[1] in ("scales", "weight"):
                if any(leaf[0].endswith(p) for p in ZEROED):
                    tensors[name] = torch.zeros_like(tensors[name])
        # Through a new file: the loaded tensors may still map the old one.
        save_file(tensors, file.with_suffix(".tmp"))
        file.with_suffix(".tmp").replace(file)
        kept = {n: t for n, t in tensors.items() if (_layer(n) or 0) < draft_layers}
        if kept:
            save_file(kept, draft / file.name)
            draft_index.update({n: file.name for n in kept})
    if (target / "model.safetensors.index.json").is_file():
        index = {"weight_map": draft_index}
        (draft / "model.safetensors.index.json").write_text(json.dumps(index))
    (draft / "config.json").write_text(
        json.dumps({**config, "num_hidden_layers": draft_layers}, indent=1)
    )
    for extra in target.iterdir():
        if extra.suffix in (".json", ".model") and not (draft / extra.name).exists():
            (draft / extra.name).write_bytes(extra.read_bytes())


def build_pair(work: Path, shape: str, draft_layers: int) -> tuple[Path, Path]:
    """The pass-through 4-bit target and its exact draft (see the module docstring)."""
    target = work / f"{shape}-gptq-passthrough{draft_layers}"
    draft = work / f"{shape}-gptq-draft{draft_layers}"
    if (target / "config.json").is_file() and (draft / "config.json").is_file():
        return target, draft
    build_model(target, shape, "gptq")
    make_passthrough_pair(target, draft, draft_layers)
    return target, draft


def _engine(path: Path, max_seq_len: int, jobs: int, **spec) -> Engine:
    options = EngineOptions(
        device="cuda",
        dtype="float16",
        max_seq_len=max_seq_len,
        cache_tokens=jobs * (max_seq_len + 64),
        max_batch=max(jobs, 1),
        prefix_caching=False,
        **spec,
    )
    return Engine.load(path, options)


def _generate(engine: Engine, prompts: list[list[int]], new_tokens: int):
    settings = {"max_new_tokens": new_tokens, "temperature": 0, "ban_eos_token": True}
    jobs = [engine.scheduler.submit(p, settings) for p in prompts]
    torch.cuda.synchronize()
    start = time.perf_counter()
    first: float | None = None
    for event in engine.scheduler.stream_many(jobs):
        if first is None and event.token_ids:
            first = time.perf_counter()  # decode speed: from the first token on
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - (first or start)
    tokens = sum(len(j.generated_ids) for j in jobs) - len(jobs)
    return tokens / elapsed, [j.generated_ids for j in jobs]


def measure(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    _generate(engine, prompts, new_tokens)  # warm-up: kernels, graph buckets
    before = engine.scheduler.stats()
    runs = [_generate(engine, prompts, new_tokens) for _ in range(3)]
    after = engine.scheduler.stats()
    drafted = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    return {
        "tok_s": statistics.median(r[0] for r in runs),
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_step": after["tokens_per_step"],
        "outputs": runs[-1][1],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1])
    parser.add_argument("--modes", nargs="+", default=["draft", "ngram"])
    parser.add_argument("--work", default="/tmp/kestrel-bench")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import triton

    target, draft = build_pair(Path(args.work), args.shape, args.draft_layers)
    vocab = SHAPES[args.shape]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    max_seq_len = args.prompt + args.new_tokens + args.num_draft_tokens + 16
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": args.shape,
        "format": "gptq 4-bit g128",
        "draft_layers": args.draft_layers,
        "num_draft_tokens": args.num_draft_tokens,
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "results": [],
    }
    spec = {
        "draft": {"draft_model": str(draft), "num_draft_tokens": args.num_draft_tokens},
        "ngram": {"speculative": "ngram", "num_draft_tokens": args.num_draft_tokens},
    }
    for n in args.concurrency:
        random_prompts = [
            torch.randint(2, vocab, (args.prompt,), generator=gen).tolist() for _ in range(n)
        ]
        repeating = []
        for _ in range(n):
            block = torch.randint(2, vocab, (64,), generator=gen).tolist()
            repeating.append((block * (args.prompt // 64 + 1))[: args.prompt])
        for mode in args.modes:
            prompts = repeating if mode == "ngram" else random_prompts
            plain = _engine(target, max_seq_len, n)
            base = measure(plain, prompts, args.new_tokens)
            plain.unload()
            # Draft at every concurrency measured (the default stops above 16 jobs).
            engine = _engine(target, max_seq_len, n, **spec[mode], speculative_max_batch=n)
            fast = measure(engine, prompts, args.new_tokens)
            engine.unload()
            row = {
                "mode": mode,
                "concurrency": n,
                "plain_tok_s": round(base["tok_s"], 1),
                "speculative_tok_s": round(fast["tok_s"], 1),
                "speedup": round(fast["tok_s"] / base["tok_s"], 3),
                "acceptance_rate": fast["acceptance_rate"],
                "tokens_per_step": fast["tokens_per_step"],
                "identical_output": fast["outputs"] == base["outputs"],
            }
            info["results"].append(row)
            print(json.dumps(row), flush=True)
    print(f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}, {args.shape} gptq")
    for r in info["results"]:
        print(
            f"{r['mode']:6s} x{r['concurrency']:<3d} plain {r['plain_tok_s']:8.1f} tok/s  "
            f"speculative {r['speculative_tok_s']:8.1f} tok/s  speed-up {r['speedup']:.2f}  "
            f"acceptance {r['acceptance_rate']}  tokens/step {r['tokens_per_step']}  "
            f"identical {r['identical_output']}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
