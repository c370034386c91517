"""Speed benchmark on a GPU: Kestrel against exllamav2 on the same random-weight model.

    python tools/bench.py --shape llama3-8b --format gptq --prompts 512 2048 \
        --json bench/results/run.json
    python tools/bench.py --shape llama3-8b --prompts 8192 --engines kestrel \
        --cache-types fp16 fp8 q8 q6 q4 --json bench/results/kv_cache_types.json

Builds a random-weight model of a real shape directly in the quantized format (random
codes, realistic scales: speed does not depend on values), writes it once to --work so
both engines load the same files, then measures for each engine:
  - batch-1 decode tok/s: prompt of P tokens, 128 new tokens, greedy, median of 5 runs
    after 2 warm-ups (exllamav2 additionally gets 210 warm-up calls first: it starts CUDA
    graphs only after 205 identical calls);
  - prefill tok/s of the P-token prompt;
  - VRAM allocated after load.
--cache-types repeats the Kestrel run per KV cache storage type (decode at long contexts is
where the cache's bytes show).
The GPU name and torch/Triton versions are printed and stored with the numbers. The full
benchmark of DESIGN.md (concurrency, roofline, plots, transformers) grows from this file.
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
from engine.quant.bitpack import pack_along_columns, pack_bitstream  # noqa: E402
from engine.quant.exl2_writer import pack_exl2  # noqa: E402

SHAPES = {
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    ),
    "llama3-70b": dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
    ),
    "tiny": dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
    ),
}  # fmt: skip
NEW_TOKENS = 128


def _linears(shape: dict) -> list[tuple[str, int, int]]:
    h, i = shape["hidden_size"], shape["intermediate_size"]
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    per_layer = [
        ("self_attn.q_proj", h, h), ("self_attn.k_proj", h, kv), ("self_attn.v_proj", h, kv),
        ("self_attn.o_proj", h, h), ("mlp.gate_proj", h, i), ("mlp.up_proj", h, i),
        ("mlp.down_proj", i, h),
    ]  # fmt: skip
    names = [
        (f"model.layers.{n}.{leaf}", k, o)
        for n in range(shape["num_hidden_layers"])
        for leaf, k, o in per_layer
    ]
    return names + [("lm_head", h, shape["vocab_size"])]


def _random_quantized(
    fmt: str, k: int, n: int, head: bool, gen: torch.Generator, perm: torch.Tensor | None = None
) -> dict:
    dev = "cuda"
    if fmt == "gptq":
        codes = torch.randint(0, 16, (k, n), device=dev, generator=gen, dtype=torch.int32)
        groups = k // 128
        zeros = torch.full((groups, n), 7, device=dev, dtype=torch.int32)  # v1: 8 - 1
        return {
            "qweight": pack_bitstream(codes, 4),
            "qzeros": pack_along_columns(zeros, 4),
            # About 1/sqrt(k) per weight: activations stay finite through every layer, so
            # greedy tokens compare between engines and placements (speed is the same).
            "scales": (
                (torch.rand(groups, n, device=dev, generator=gen) + 1) * 0.2 / k**0.5
            ).half(),
            "g_idx": (torch.arange(k, device=dev, dtype=torch.int32) // 128),
        }
    bits = 6 if head else 4
    groups = -(-k // 128)
    codes = torch.randint(0, 1 << bits, (k, n), device=dev, generator=gen, dtype=torch.int32)
    return pack_exl2(
        codes,
        [bits] * groups,
        [128] * (k // 128) + ([k % 128] if k % 128 else []),
        torch.randint(0, 16, (groups, n), device=dev, generator=gen, dtype=torch.int32),
        (torch.rand(groups, device=dev, generator=gen) * 0.01 + 0.001).half(),
        perm if perm is not None else torch.randperm(k, device=dev, generator=gen).to(torch.int32),
    )


def build_model(path: Path, shape_name: str, fmt: str) -> Path:
    """Write a random-weight model of `shape_name` in `fmt` (gptq: 4-bit g128; exl2: 4-bit
    with a 6-bit head) with a word-level tokenizer; skipped if already there."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    if (path / "config.json").is_file():
        return path
    shape = SHAPES[shape_name]
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    shard, shard_bytes, index = 0, 0, {}

    def flush() -> None:
        nonlocal shard, shard_bytes, tensors
        if tensors:
            fname = f"model-{shard:05d}.safetensors"
            save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, path / fname)
            index.update({k: fname for k in tensors})
            shard, shard_bytes, tensors = shard + 1, 0, {}

    h, vocab = shape["hidden_size"], shape["vocab_size"]
    tensors["model.embed_tokens.weight"] = (torch.randn(vocab, h, device="cuda") * 0.02).half()
    tensors["model.norm.weight"] = torch.ones(h, device="cuda", dtype=torch.float16)
    for n in range(shape["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{n}.{norm}.weight"] = torch.ones(h, dtype=torch.float16)
    # Linears that read the same input share EXL2's act-order permutation, as a converter
    # makes them (one Hessian): q/k/v, and gate/up.
    shared: dict[str, torch.Tensor] = {}
    for name, k, o in _linears(shape):
        group = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
        group = group.replace("up_proj", "gate_proj")
        if group not in shared:
            shared = {group: torch.randperm(k, device="cuda", generator=gen).to(torch.int32)}
        quantized = _random_quantized(fmt, k, o, name == "lm_head", gen, shared[group])
        for key, t in quantized.items():
            tensors[f"{name}.{key}"] = t
            shard_bytes += t.numel() * t.element_size()
        if shard_bytes > 2 << 30:
            flush()
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape,
        "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "float16",
    }  # fmt: skip
    if fmt == "gptq":
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
            "sym": True, "checkpoint_format": "gptq",
        }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t0", "eos_token": "t1"}))
    return path


def _median_runs(run, warmups: int = 2, runs: int = 5) -> float:
    for _ in range(warmups):
        run()
    return statistics.median(run() for _ in range(runs))


def decode_tok_s(engine: Engine, prompt: list[int]) -> float:
    """Batch-1 decode speed after `prompt`: NEW_TOKENS greedy steps, median of 5 runs."""

    def run() -> float:
        seq = Sequence()
        token = int(engine.prefill(seq, prompt)[-1].argmax())
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(NEW_TOKENS):
            token = int(engine.forward([seq], [[token]])[-1].argmax())
        elapsed = time.perf_counter() - t
        seq.release(engine.cache)
        return NEW_TOKENS / elapsed

    return _median_runs(run)


def prefill_tok_s(engine: Engine, prompt: list[int]) -> float:
    """Prefill speed of `prompt` (tokens/s), median of 5 runs."""

    def run() -> float:
        seq = Sequence()
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.prefill(seq, prompt)
        torch.cuda.synchronize()
        seq.release(engine.cache)
        return len(prompt) / (time.perf_counter() - t)

    return _median_runs(run)


def bench_kestrel(path: Path, prompt_len: int, cache_type: str = "fp16") -> dict:
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    engine = Engine.load(
        path,
        EngineOptions(
            device="cuda",
            dtype="float16",
            max_seq_len=prompt_len + NEW_TOKENS + 16,
            cache_type=cache_type,
        ),
    )
    load_s = time.perf_counter() - t0
    vram = (torch.cuda.memory_allocated() - base) / 2**30
    vocab = engine.config.vocab_size
    prompt = torch.randint(2, vocab, (prompt_len,)).tolist()

    result = {
        "decode_tok_s": decode_tok_s(engine, prompt),
        "prefill_tok_s": prefill_tok_s(engine, prompt),
        "vram_gib": vram,
        "load_s": load_s,
        "cache_type": cache_type,
        "cache_mib": engine.cache.total_bytes / 2**20,
    }
    engine.unload()
    return result


def bench_concurrency(path: Path, levels: list[int], prompt_len: int = 128) -> list[dict]:
    """Aggregate tok/s of N concurrent jobs (greedy, NEW_TOKENS each, distinct prompts)
    through the scheduler: continuous batching, decode steps as bucketed CUDA graphs."""
    most = max(levels)
    per_job = prompt_len + NEW_TOKENS
    engine = Engine.load(
        path,
        EngineOptions(
            device="cuda",
            dtype="float16",
            max_seq_len=per_job + 16,
            cache_tokens=most * (per_job + 256),
            max_batch=most,
            prefix_caching=False,
        ),
    )
    vocab = engine.config.vocab_size
    settings = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ban_eos_token": True}
    results = []

    def run(n: int) -> tuple[float, int]:
        jobs = [
            engine.scheduler.submit(torch.randint(2, vocab, (prompt_len,)).tolist(), settings)
            for _ in range(n)
        ]
        torch.cuda.synchronize()
        t = time.perf_counter()
        tokens = sum(len(e.token_ids) for e in engine.scheduler.stream_many(jobs))
        torch.cuda.synchronize()
        return time.perf_counter() - t, tokens

    for n in levels:
        run(n)  # captures the graph bucket and compiles kernels for this batch size
        timings = [run(n) for _ in range(3)]
        seconds, tokens = sorted(timings)[1]
        results.append(
            {"engine": "kestrel", "concurrency": n, "aggregate_tok_s": tokens / seconds,
             "tokens": tokens, "seconds": seconds, "prompt": prompt_len}
        )  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    engine.unload()
    return results


def bench_exllamav2(path: Path, prompt_len: int) -> dict:
    from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config

    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    config = ExLlamaV2Config(str(path))
    config.max_seq_len = prompt_len + 256  # room for the 210-step warm-up
    config.max_input_len = min(2048, prompt_len)
    config.max_attention_size = config.max_input_len**2
    model = ExLlamaV2(config)
    model.load()
    cache = ExLlamaV2Cache(model, max_seq_len=config.max_seq_len)
    load_s = time.perf_counter() - t0
    vram = (torch.cuda.memory_allocated() - base) / 2**30
    prompt = torch.randint(2, config.vocab_size, (1, prompt_len))

    def prefill() -> float:
        cache.current_seq_len = 0
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.forward(prompt, cache, preprocess_only=True)
        torch.cuda.synchronize()
        return prompt_len / (time.perf_counter() - t)

    def decode(steps: int = NEW_TOKENS) -> float:
        cache.current_seq_len = 0
        model.forward(prompt[:, :-1], cache, preprocess_only=True)
        token = prompt[:, -1:]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            logits = model.forward(token, cache)
            token = logits[:, -1:].argmax(-1).cpu()
        return steps / (time.perf_counter() - t)

    with torch.inference_mode():
        decode(210)  # past exllamav2's CUDA-graph threshold of 205 identical calls
        result = {
            "decode_tok_s": _median_runs(decode),
            "prefill_tok_s": _median_runs(prefill),
            "vram_gib": vram,
            "load_s": load_s,
        }
    model.unload()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    parser.add_argument("--format", default="gptq", choices=["gptq", "exl2"])
    parser.add_argument("--prompts", type=int, nargs="+", default=[512])
    parser.add_argument("--work", default="/tmp/kestrel-bench")
    parser.add_argument("--engines", nargs="+", default=["kestrel", "exllamav2"])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[])
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--cache-types",
        nargs="+",
        default=["fp16"],
        help="Kestrel KV cache types to measure (fp16 fp8 q8 q6 q4): one Kestrel run each",
    )
    args = parser.parse_args()
    import triton

    path = build_model(Path(args.work) / f"{args.shape}-{args.format}", args.shape, args.format)
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": args.shape,
        "format": args.format,
        "new_tokens": NEW_TOKENS,
        "results": [],
    }
    for prompt_len in args.prompts:
        runs = [
            (name, cache_type)
            for name in args.engines
            for cache_type in (args.cache_types if name == "kestrel" else ["fp16"])
        ]
        for name, cache_type in runs:
            try:
                if name == "kestrel":
                    r = bench_kestrel(path, prompt_len, cache_type)
                else:
                    r = bench_exllamav2(path, prompt_len)
            except Exception as e:  # one engine failing must not lose the other's numbers
                r = {"error": f"{type(e).__name__}: {e}"}
            r.update(engine=name, prompt=prompt_len, cache_type=cache_type)
            info["results"].append(r)
            print(json.dumps(r), flush=True)
    if args.concurrency:
        info["concurrency"] = bench_concurrency(path, args.concurrency)
    print(f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}, "
          f"{args.shape} {args.format}")  # fmt: skip
    for r in info["results"]:
        if "error" in r:
            print(f"{r['engine']:10s} P={r['prompt']:5d} {r['cache_type']:4s}  {r['error']}")
        else:
            print(
                f"{r['engine']:10s} P={r['prompt']:5d} {r['cache_type']:4s}  "
                f"decode {r['decode_tok_s']:7.1f} tok/s  "
                f"prefill {r['prefill_tok_s']:8.0f} tok/s  VRAM {r['vram_gib']:.2f} GiB  "
                f"load {r['load_s']:.1f} s"
            )
    for r in info.get("concurrency", []):
        print(f"kestrel    {r['concurrency']:3d} jobs  aggregate {r['aggregate_tok_s']:8.0f} tok/s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
