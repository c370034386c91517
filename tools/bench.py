"""Speed benchmark on a GPU: Kestrel, exllamav2 and transformers FP16 on the same
random-weight model, with the memory-bandwidth roofline (DESIGN.md, "Benchmarks").

    python tools/bench.py --shape llama3-8b --format gptq --prompts 512 2048 8192 \
        --engines kestrel exllamav2 transformers --concurrency 1 8 32 64 \
        --json bench/results/run.json            # also writes bench/results/run.png
    python tools/bench.py --shape llama3-8b --prompts 8192 --engines kestrel \
        --cache-types fp16 fp8 q8 q6 q4 --json bench/results/kv_cache_types.json

Builds a random-weight model of a real shape directly in the quantized format (random
codes, realistic scales: speed does not depend on values), writes it once to --work so
every engine loads the same files, measures the device's read bandwidth once, then for
each engine and prompt length P:
  - batch-1 decode tok/s: prompt of P tokens, 128 new tokens, greedy, median of 5 runs
    after 2 warm-ups (exllamav2 additionally gets 210 warm-up calls first: it starts CUDA
    graphs only after 205 identical calls; transformers, at a few dozen tok/s, gets median
    of 3 after 1 warm-up): each step a forward, an argmax and a read of the token, the
    same synchronous loop for every engine. Kestrel also reports `scheduler_decode_tok_s`,
    one job through its scheduler, which the UI and the API use (lookahead: the next
    forward starts before the token is read), from the first token to the last;
  - prefill tok/s of the P-token prompt;
  - VRAM allocated after load, and the load time;
  - bytes read per decoded token, the roofline (read bandwidth / those bytes) and the
    fraction of it that decode reaches (see `result_bytes_per_token` for what is counted).
Engines (--engines): kestrel; exllamav2 (needs its wheel); transformers: HF
LlamaForCausalLM in FP16 whose linears are Kestrel's dequantized weights of the same files
(see `build_transformers_model`), skipped with an error entry if it does not fit the GPU.
--cache-types repeats the Kestrel run per KV cache storage type (decode at long contexts is
where the cache's bytes show). --concurrency N... measures Kestrel's aggregate tok/s with N
concurrent jobs through the scheduler; DESIGN.md asks for 1 8 32 64 (given without values
it measures nothing).
Writes --json (the GPU name, torch/Triton versions, model shape, bandwidth, every result and
the Kestrel / exllamav2 ratios per prompt) and a PNG plot (--plot, default the --json path
with .png; needs matplotlib): decode tok/s against context with the rooflines dashed, and
aggregate tok/s against concurrency. Figures from different runs or machines are not
compared.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.cache import Sequence, cache_bytes_per_token
from engine.engine import Engine, EngineOptions
from engine.quant.bitpack import pack_along_columns, pack_bitstream
from engine.quant.exl2_writer import pack_exl2

ROOT = Path(__file__).resolve().parent.parent

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
# Context past the prompt that both engines get (exllamav2's 210-step warm-up needs room),
# so their "VRAM after load" holds caches of the same length.
CONTEXT_ROOM = 256
ENGINES = ("kestrel", "exllamav2", "transformers")
DESIGN_CONCURRENCY = (1, 8, 32, 64)  # the levels DESIGN.md's benchmark reports
EMBED = "model.embed_tokens.weight"


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
    fmt: str,
    k: int,
    n: int,
    head: bool,
    gen: torch.Generator,
    perm: torch.Tensor | None = None,
    dev: str = "cuda",
    head_bits: int = 6,
) -> dict:
    if fmt == "gptq":
        # Codes 1..15 around the zero point 8: weights of mean zero. With 0..15 every weight
        # had a mean of -scale/2, the outputs shared that common part, and it grew with the
        # width from layer to layer: at 70B widths the MLP's outputs reached ~6,000 by the
        # third layer and the fp16 residual overflowed (non-finite logits) long before the
        # 80th. Speed does not depend on the codes' values.
        codes = torch.randint(1, 16, (k, n), device=dev, generator=gen, dtype=torch.int32)
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
    bits = head_bits if head else 4
    groups = -(-k // 128)
    # Around EXL2's implicit zero of 2^(bits-1), of mean zero as for GPTQ above.
    codes = torch.randint(1, 1 << bits, (k, n), device=dev, generator=gen, dtype=torch.int32)
    return pack_exl2(
        codes,
        [bits] * groups,
        [128] * (k // 128) + ([k % 128] if k % 128 else []),
        torch.randint(0, 16, (groups, n), device=dev, generator=gen, dtype=torch.int32),
        (torch.rand(groups, device=dev, generator=gen) * 0.01 + 0.001).half(),
        perm if perm is not None else torch.randperm(k, device=dev, generator=gen).to(torch.int32),
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--shape, --format, --work (where `build_model` keeps the files) and --out: the
    arguments the profiling and tuning tools share."""
    parser.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    parser.add_argument("--format", default="gptq", choices=["gptq", "exl2"])
    parser.add_argument("--work", default="/tmp/kestrel-bench")
    parser.add_argument("--out", default=".")


def model_from_arguments(args: argparse.Namespace) -> tuple[Path, Path]:
    """The model `add_model_arguments` names, built if needed, and the --out folder (made)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = build_model(Path(args.work) / f"{args.shape}-{args.format}", args.shape, args.format)
    return path, out


def build_model(
    path: Path,
    shape_name: str,
    fmt: str,
    device: str = "cuda",
    layers: int | None = None,
    exl2_head_bits: int = 6,
) -> Path:
    """Write a random-weight model of `shape_name` in `fmt` (gptq: 4-bit g128, its head
    too; exl2: 4-bit with a head of `exl2_head_bits`, 6 as exllamav2's converter makes it)
    with a word-level tokenizer; skipped if already there. `device` is where the codes are
    drawn and packed (the CPU serves tests with a tiny shape). `layers`: this many decoder
    layers instead of the shape's (a profile of a few layers of a 70B builds and loads in
    seconds)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    if (path / "config.json").is_file():
        return path
    shape = dict(SHAPES[shape_name])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    shard, shard_bytes, index = 0, 0, {}

    def flush() -> None:
        nonlocal shard, shard_bytes, tensors
        if tensors:
            fname = f"model-{shard:05d}.safetensors"
            # A copy each: on the CPU, linears that share a permutation hold one tensor,
            # which safetensors refuses to save twice.
            save_file(
                {k: v.to("cpu", copy=True).contiguous() for k, v in tensors.items()}, path / fname
            )
            index.update({k: fname for k in tensors})
            shard, shard_bytes, tensors = shard + 1, 0, {}

    h, vocab = shape["hidden_size"], shape["vocab_size"]
    # Seeded like the linears: every machine builds the same model, so greedy tokens compare
    # across runs (tools/multigpu_check.py's single-GPU vs TP check).
    embed = torch.randn(vocab, h, device=device, generator=gen)
    tensors["model.embed_tokens.weight"] = (embed * 0.02).half()
    tensors["model.norm.weight"] = torch.ones(h, device=device, dtype=torch.float16)
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
            shared = {group: torch.randperm(k, device=device, generator=gen).to(torch.int32)}
        quantized = _random_quantized(
            fmt, k, o, name == "lm_head", gen, shared[group], device, exl2_head_bits
        )
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


# Arithmetic of the roofline and the comparisons: plain dicts in, numbers out, no GPU (so
# tests/tools/test_bench_tool.py checks it on the CPU).


def _head_dim(shape: Mapping[str, Any]) -> int:
    return shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]


def llama_param_count(shape: Mapping[str, Any]) -> int:
    """Parameters of a Llama model of `shape` (a SHAPES entry or a config.json dict), without
    biases: embeddings, per layer q/k/v/o, gate/up/down and two norms, the final norm, and
    the head unless tied to the embeddings."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    hd = _head_dim(shape)
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
    head = 0 if shape.get("tie_word_embeddings", False) else v * h
    return v * h + shape["num_hidden_layers"] * per_layer + h + head


def weight_bytes_per_token(tensor_bytes: Mapping[str, int], vocab_size: int) -> int:
    """Weight bytes one batch-1 decode step reads, from the checkpoint's tensor sizes: every
    tensor once (quantized codes, scales, zeros, permutations, norms: what the kernels load),
    except the embedding table, of which a step reads one row. Without an `lm_head.*` tensor
    the head is tied to the embeddings and reads the whole table. Kestrel and exllamav2 load
    the same files, so they share this figure; their runtime layouts differ by a few small
    index tensors (g_idx against row groups), well under 1% of the bytes."""
    embed = tensor_bytes.get(EMBED, 0)
    rest = sum(b for name, b in tensor_bytes.items() if name != EMBED)
    tied = not any(name.startswith("lm_head.") for name in tensor_bytes)
    return rest + (embed if tied else embed // vocab_size)


def fp16_weight_bytes_per_token(shape: Mapping[str, Any]) -> int:
    """The same for the model in FP16 (transformers): 2 bytes per parameter, one row of an
    untied embedding table."""
    params = llama_param_count(shape)
    if not shape.get("tie_word_embeddings", False):
        params -= (shape["vocab_size"] - 1) * shape["hidden_size"]
    return 2 * params


def kv_bytes_read(context: int, shape: Mapping[str, Any], cache_type: str = "fp16") -> int:
    """K and V bytes a decode step reads at `context` tokens: every cached token's K and V
    rows in every layer, in the engine's own layout (engine/cache.py). For fp16 that is
    2 (K, V) * layers * kv_heads * head_dim * 2 bytes per token; the quantized types store
    codes plus fp16 scales per row, padded to 16 bytes (what attention loads), e.g. at
    head_dim 128: fp8 and q8 1.125, q6 0.875, q4 0.625 bytes per element. The context is
    the prompt length: decode runs from P to P + NEW_TOKENS, whose mean adds 64 tokens
    (8 MiB at 8B, fp16) to the >= 3.6 GB counted per step: a fraction of a percent."""
    per_token = cache_bytes_per_token(
        cache_type,
        num_layers=shape["num_hidden_layers"],
        num_kv_heads=shape["num_key_value_heads"],
        head_dim=_head_dim(shape),
        dtype=torch.float16,
    )
    return context * per_token


def result_bytes_per_token(
    result: Mapping[str, Any], shape: Mapping[str, Any], quantized_weight_bytes: int
) -> int:
    """Bytes a decode step of `result` (engine, prompt, cache_type) reads: its weights
    (the quantized files for Kestrel and exllamav2, FP16 for transformers) and its KV cache
    at the prompt's length (exllamav2 and transformers keep an fp16 cache)."""
    if result["engine"] == "transformers":
        weights = fp16_weight_bytes_per_token(shape)
    else:
        weights = quantized_weight_bytes
    cache_type = result.get("cache_type", "fp16") if result["engine"] == "kestrel" else "fp16"
    return weights + kv_bytes_read(result["prompt"], shape, cache_type)


def roofline_fields(decode_tok_s: float, bytes_per_token: int, bandwidth: float) -> dict:
    """Roofline of batch-1 decode, which must read `bytes_per_token` per step at best at the
    measured read `bandwidth` (bytes/s), and the fraction of it that `decode_tok_s` reaches."""
    roofline = bandwidth / bytes_per_token
    return {
        "bytes_per_token": bytes_per_token,
        "roofline_tok_s": roofline,
        "fraction_of_roofline": decode_tok_s / roofline,
    }


def _measured(result: Mapping[str, Any]) -> bool:
    return "error" not in result and "decode_tok_s" in result


def ratios_vs_exllamav2(results: list[dict]) -> list[dict]:
    """Kestrel (fp16 KV cache, as exllamav2's) over exllamav2 at each prompt length both
    measured: {"prompt", "decode", "prefill"}, in the order of the Kestrel results."""
    exl2 = {r["prompt"]: r for r in results if r["engine"] == "exllamav2" and _measured(r)}
    ratios = []
    for r in results:
        if r["engine"] != "kestrel" or r.get("cache_type", "fp16") != "fp16" or not _measured(r):
            continue
        other = exl2.get(r["prompt"])
        if other is not None:
            ratios.append(
                {
                    "prompt": r["prompt"],
                    "decode": r["decode_tok_s"] / other["decode_tok_s"],
                    "prefill": r["prefill_tok_s"] / other["prefill_tok_s"],
                }
            )
    return ratios


def model_tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of every tensor in the model's safetensors files (read from the headers only)."""
    from engine.weights import WeightStore

    store = WeightStore(path)
    sizes = {}
    for name in store.names():
        info = store.info(name)
        numel = 1
        for d in info.shape:
            numel *= d
        sizes[name] = numel * info.dtype.itemsize
    return sizes


def _median_runs(run: Callable[[], float], warmups: int = 2, runs: int = 5) -> float:
    for _ in range(warmups):
        run()
    return statistics.median(run() for _ in range(runs))


def decode_tok_s(engine: Engine, prompt: list[int]) -> float:
    """Batch-1 decode speed after `prompt`: NEW_TOKENS greedy steps, median of 5 runs."""

    def run() -> float:
        seq = Sequence()
        token = int(engine.runner.prefill(seq, prompt)[-1].argmax())
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(NEW_TOKENS):
            token = int(engine.runner.forward([seq], [[token]])[-1].argmax())
        elapsed = time.perf_counter() - t
        seq.release(engine.cache)
        return NEW_TOKENS / elapsed

    return _median_runs(run)


def scheduler_decode_tok_s(engine: Engine, prompt: list[int]) -> float:
    """Batch-1 decode speed of one job through the scheduler (what the UI and the API
    get): tokens after the first / seconds from the first token's event to the last's,
    median of 5 runs after 2 warm-ups."""
    settings = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ban_eos_token": True}

    def run() -> float:
        job = engine.scheduler.submit(prompt, settings)
        first = None
        tokens = 0
        for event in engine.scheduler.stream_many([job]):
            if event.token_ids and first is None:
                first = time.perf_counter()
                tokens -= len(event.token_ids)
            tokens += len(event.token_ids)
        assert first is not None and tokens > 0, "the job produced no tokens after its first"
        return tokens / (time.perf_counter() - first)

    return _median_runs(run)


def prefill_tok_s(engine: Engine, prompt: list[int]) -> float:
    """Prefill speed of `prompt` (tokens/s), median of 5 runs."""

    def run() -> float:
        seq = Sequence()
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.runner.prefill(seq, prompt)
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
            max_seq_len=prompt_len + CONTEXT_ROOM,
            cache_type=cache_type,
        ),
    )
    load_s = time.perf_counter() - t0
    vram = (torch.cuda.memory_allocated() - base) / 2**30
    vocab = engine.config.vocab_size
    prompt = torch.randint(2, vocab, (prompt_len,)).tolist()

    result = {
        "decode_tok_s": decode_tok_s(engine, prompt),
        "scheduler_decode_tok_s": scheduler_decode_tok_s(engine, prompt),
        "prefill_tok_s": prefill_tok_s(engine, prompt),
        "vram_gib": vram,
        "load_s": load_s,
        "cache_type": cache_type,
        "cache_mib": engine.cache.total_bytes / 2**20,
    }
    engine.unload()
    return result


def bench_concurrency(
    path: Path, levels: list[int], prompt_len: int = 128, lookahead: bool = True
) -> list[dict]:
    """Aggregate tok/s of N concurrent jobs (greedy, NEW_TOKENS each, distinct prompts)
    through the scheduler: continuous batching, decode steps as bucketed CUDA graphs, the
    next forward launched before the last tokens are read (`lookahead`)."""
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
            lookahead=lookahead,
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
             "tokens": tokens, "seconds": seconds, "prompt": prompt_len,
             "lookahead": lookahead}
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
    config.max_seq_len = prompt_len + CONTEXT_ROOM
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


def _model_shape(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def _dequantizer(device: torch.device, dtype: torch.dtype) -> Callable[[Any], torch.Tensor]:
    """QuantizedWeight -> W [k, n] in `dtype`, original row order: the Triton kernel on a
    GPU, the fp32 reference elsewhere (the same values, rounded once)."""
    if device.type == "cuda":
        from kernels.quant_matmul import dequantize_triton

        return lambda qw: dequantize_triton(qw, dtype=dtype)
    from kernels.quant_matmul import dequantize_reference

    return lambda qw: dequantize_reference(qw).to(dtype)


def build_transformers_model(
    path: Path, device: str = "cuda", dtype: torch.dtype = torch.float16
) -> nn.Module:
    """HF transformers LlamaForCausalLM of the model in `path`, in `dtype`, whose weights
    are those Kestrel computes with: each quantized linear is read and repacked by Kestrel's
    own loader (engine.quantized_linear.load_quantized_linear, the code Engine.load runs,
    before any q/k/v or gate/up fusion, so HF's module names are the checkpoint's), then
    dequantized to W [in, out] and stored transposed as HF's weight [out, in]; embeddings
    and norms come from the safetensors files. The model is built on the meta device and
    filled one linear at a time, so memory peaks at the dense model plus one linear."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.config import ModelConfig
    from engine.quantized_linear import linear_format, load_quantized_linear
    from engine.weights import WeightStore

    dev = torch.device(device)
    raw = _model_shape(path)
    # Not a GPTQ model to transformers: it gets dense weights; transformers would otherwise
    # want its own GPTQ backend for this config.
    raw.pop("quantization_config", None)
    config = LlamaConfig.from_dict(raw)
    config._attn_implementation = "sdpa"
    quant_config = ModelConfig.from_dir(path).quantization_config
    dequantize = _dequantizer(dev, dtype)
    store = WeightStore(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        out_features = module.out_features
        bias = None
        if linear_format(store, name) == "dense":
            weight = store.get(f"{name}.weight", dtype=dtype, device=dev)
            if f"{name}.bias" in store:
                bias = store.get(f"{name}.bias", dtype=dtype, device=dev)
        else:
            linear = load_quantized_linear(
                store,
                name,
                in_features=module.in_features,
                out_features=out_features,
                device=dev,
                quantization_config=quant_config,
            )
            # EXL2 pads the output columns to a multiple of 32: keep the model's own.
            weight = dequantize(linear.qweight)[:, :out_features].T.contiguous()
            if linear.qweight.bias is not None:
                bias = linear.qweight.bias[:out_features].to(dtype)
            del linear
        if tuple(weight.shape) != tuple(module.weight.shape):
            raise ValueError(
                f"{name}: weight {list(weight.shape)}, transformers expects "
                f"{list(module.weight.shape)}"
            )
        module.weight = nn.Parameter(weight, requires_grad=False)
        if module.bias is not None:
            if bias is None:
                bias = torch.zeros(out_features, dtype=dtype, device=dev)
            module.bias = nn.Parameter(bias, requires_grad=False)
    # Embeddings and norms: every parameter still on the meta device.
    for name, param in list(model.named_parameters()):
        if param.device.type != "meta":
            continue
        tensor = store.get(name, dtype=dtype, device=dev, shape=tuple(param.shape))
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, nn.Parameter(tensor, requires_grad=False))
    store.close()
    # The rotary embedding's inverse frequencies are computed at construction, so they are
    # meta tensors here: a fresh module, in float32 as transformers keeps them.
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config).to(dev)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"transformers model left without weights: {', '.join(left[:5])}")
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def bench_transformers(path: Path, prompt_len: int) -> dict:
    """HF transformers FP16 on the same weights (build_transformers_model): batch-1 greedy
    decode through its DynamicCache, prefill, VRAM. Median of 3 after 1 warm-up: it decodes
    at a few dozen tok/s at 8B."""
    shape = _model_shape(path)
    gc.collect()
    torch.cuda.empty_cache()  # memory the previous engine left in torch's pool counts as free
    need = 2 * llama_param_count(shape)
    free = torch.cuda.mem_get_info()[0]
    if need > 0.9 * free:
        return {
            "error": f"the FP16 model needs {need / 2**30:.1f} GiB of GPU memory, more than "
            f"90% of the {free / 2**30:.1f} GiB free"
        }
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model = build_transformers_model(path, "cuda", torch.float16)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    vram = (torch.cuda.memory_allocated() - base) / 2**30
    prompt = torch.randint(2, shape["vocab_size"], (1, prompt_len), device="cuda")
    try:
        decode, prefill = _transformers_speeds(model, prompt)
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return {"decode_tok_s": decode, "prefill_tok_s": prefill, "vram_gib": vram, "load_s": load_s}


def _transformers_speeds(model: nn.Module, prompt: torch.Tensor) -> tuple[float, float]:
    """(decode tok/s, prefill tok/s) of a transformers model after `prompt` [1, P]."""
    prompt_len = prompt.shape[1]
    # transformers 5.x renames `past_key_values` to `cache` (argument and output field),
    # deprecating the old name: use whichever this version's forward takes.
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    # No-op on the CPU, where tests run this loop on a tiny model.
    sync = torch.cuda.synchronize if prompt.is_cuda else lambda: None

    def prefill() -> float:
        sync()
        t = time.perf_counter()
        # Logits of the last position only, as the other engines compute for a prompt.
        model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        sync()
        return prompt_len / (time.perf_counter() - t)

    def decode() -> float:
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        sync()
        t = time.perf_counter()
        for _ in range(NEW_TOKENS):
            out = model(input_ids=token, use_cache=True, **{arg: getattr(out, arg)})
            token = out.logits[:, -1:].argmax(-1)
            int(token)  # to the host every step, as Kestrel's and exllamav2's loops do
        return NEW_TOKENS / (time.perf_counter() - t)

    with torch.inference_mode():
        return _median_runs(decode, warmups=1, runs=3), _median_runs(prefill, warmups=1, runs=3)


def _series_label(result: Mapping[str, Any]) -> str:
    if result["engine"] == "kestrel":
        return f"kestrel ({result.get('cache_type', 'fp16')} cache)"
    if result["engine"] == "transformers":
        return "transformers FP16"
    return result["engine"]


def plot_results(info: Mapping[str, Any], path: Path) -> bool:
    """PNG of `info` (main's JSON): decode tok/s against context per engine (and Kestrel
    cache type) with each one's roofline dashed; aggregate tok/s against concurrency.
    Returns False, with a warning, when matplotlib is missing."""
    try:  # optional: only the plot needs it
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("warning: matplotlib is not installed, no plot written", file=sys.stderr)
        return False
    # A Figure on the Agg canvas: no pyplot, so no display or global backend is touched.
    fig = Figure(figsize=(13, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    series: dict[str, list[Mapping[str, Any]]] = {}
    for r in info.get("results", []):
        if _measured(r):
            series.setdefault(_series_label(r), []).append(r)
    prompts = sorted({r["prompt"] for rs in series.values() for r in rs})
    for i, (label, rs) in enumerate(series.items()):
        rs = sorted(rs, key=lambda r: r["prompt"])
        x = [r["prompt"] for r in rs]
        color = f"C{i % 10}"
        left.plot(x, [r["decode_tok_s"] for r in rs], marker="o", color=color, label=label)
        if all("roofline_tok_s" in r for r in rs):
            # "_" markers keep a single-prompt roofline visible (a lone point draws no line).
            left.plot(
                x,
                [r["roofline_tok_s"] for r in rs],
                linestyle="--",
                marker="_",
                markersize=14,
                color=color,
                label=f"{label} roofline",
            )
    if prompts:
        left.set_xscale("log", base=2)
        left.set_xticks(prompts, [str(p) for p in prompts])
        left.legend(fontsize="small")
    left.set_xlabel("context: prompt tokens")
    left.set_ylabel(f"decode tok/s (batch 1, {info.get('new_tokens', NEW_TOKENS)} new tokens)")
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    levels = [c for c in info.get("concurrency", []) if "aggregate_tok_s" in c]
    if levels:
        x = [c["concurrency"] for c in levels]
        right.plot(x, [c["aggregate_tok_s"] for c in levels], marker="o", label="kestrel")
        right.set_xscale("log", base=2)
        right.set_xticks(x, [str(n) for n in x])
        right.legend(fontsize="small")
    else:
        right.text(0.5, 0.5, "concurrency not measured", ha="center", va="center")
    right.set_xlabel("concurrent jobs")
    right.set_ylabel("aggregate tok/s")
    right.set_ylim(bottom=0)
    right.grid(alpha=0.3)
    bandwidth = info.get("read_bandwidth_gb_s")
    fig.suptitle(
        f"{info.get('gpu', '?')}: {info.get('shape', '?')} {info.get('format', '?')}"
        + (f", read bandwidth {bandwidth:.0f} GB/s" if bandwidth else "")
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def summary_lines(info: Mapping[str, Any]) -> list[str]:
    """The final table: one line per result, with roofline fraction and, for engines other
    than exllamav2, the ratio to exllamav2 at the same prompt."""
    lines = [
        f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}, "
        f"{info['shape']} {info['format']}"
        + (
            f", read bandwidth {info['read_bandwidth_gb_s']:.0f} GB/s"
            if info.get("read_bandwidth_gb_s")
            else ""
        )
    ]
    exl2 = {r["prompt"]: r for r in info["results"] if r["engine"] == "exllamav2" and _measured(r)}
    for r in info["results"]:
        row = f"{r['engine']:12s} P={r['prompt']:5d} {r['cache_type']:4s}  "
        if not _measured(r):
            lines.append(row + r.get("error", "no result"))
            continue
        row += (
            f"decode {r['decode_tok_s']:7.1f} tok/s  prefill {r['prefill_tok_s']:8.0f} tok/s  "
            f"VRAM {r['vram_gib']:5.2f} GiB  load {r['load_s']:5.1f} s"
        )
        if "fraction_of_roofline" in r:
            row += f"  roofline {r['roofline_tok_s']:6.0f} ({r['fraction_of_roofline']:.0%})"
        if "scheduler_decode_tok_s" in r:
            row += f"  scheduler decode {r['scheduler_decode_tok_s']:7.1f} tok/s"
        other = exl2.get(r["prompt"])
        if other is not None and r["engine"] != "exllamav2":
            row += (
                f"  vs exllamav2: decode {r['decode_tok_s'] / other['decode_tok_s']:.2f}x"
                f" prefill {r['prefill_tok_s'] / other['prefill_tok_s']:.2f}x"
            )
        lines.append(row)
    for c in info.get("concurrency", []):
        lines.append(
            f"kestrel      {c['concurrency']:3d} jobs  aggregate {c['aggregate_tok_s']:8.0f} tok/s"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    parser.add_argument("--format", default="gptq", choices=["gptq", "exl2"])
    parser.add_argument("--prompts", type=int, nargs="+", default=[512])
    parser.add_argument(
        "--exl2-head-bits",
        type=int,
        default=6,
        choices=[4, 6, 8],
        help="bits of the EXL2 model's head (6, exllamav2's default; 4 compares EXL2 with "
        "GPTQ, whose head is 4-bit, at the same bits)",
    )
    parser.add_argument("--work", default="/tmp/kestrel-bench")
    parser.add_argument(
        "--engines", nargs="+", default=["kestrel", "exllamav2"], choices=list(ENGINES)
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        default=[],
        help="Kestrel aggregate tok/s at these numbers of concurrent jobs; DESIGN.md asks "
        f"for {' '.join(map(str, DESIGN_CONCURRENCY))} (without values: not measured)",
    )
    parser.add_argument(
        "--constrained",
        default=None,
        metavar="TOKENIZER_DIR",
        help="also measure constrained decoding (tools/bench_constrained.py) with this "
        "tokenizer (e.g. Llama-3's, written by tools/rank_tokenizer.py): batch 1 and 64 jobs",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--plot", default=None, help="PNG plot path (default: the --json path with .png)"
    )
    parser.add_argument(
        "--cache-types",
        nargs="+",
        default=["fp16"],
        help="Kestrel KV cache types to measure (fp16 fp8 q8 q6 q4): one Kestrel run each",
    )
    args = parser.parse_args()
    import triton

    # Another head width is another model: its own folder (the default keeps the old name).
    head = args.exl2_head_bits if args.format == "exl2" else None
    name = f"{args.shape}-{args.format}" + (f"-head{head}" if head not in (None, 6) else "")
    path = build_model(
        Path(args.work) / name, args.shape, args.format, exl2_head_bits=args.exl2_head_bits
    )
    shape = SHAPES[args.shape]
    quantized_bytes = weight_bytes_per_token(model_tensor_bytes(path), shape["vocab_size"])
    bandwidth = None
    try:  # imported here: profile_decode imports this module (and needs a GPU to run)
        from tools.profile_decode import _read_bandwidth

        bandwidth = _read_bandwidth()
    except Exception as e:  # the speeds are worth keeping without their roofline
        print(f"warning: read bandwidth not measured, no roofline ({type(e).__name__}: {e})")
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": args.shape,
        "model_shape": shape,
        "format": args.format,
        "exl2_head_bits": head,
        "new_tokens": NEW_TOKENS,
        "read_bandwidth_gb_s": bandwidth / 1e9 if bandwidth else None,
        "quantized_weight_bytes_per_token": quantized_bytes,
        "results": [],
    }
    others: dict[str, Callable[[Path, int], dict]] = {
        "exllamav2": bench_exllamav2,
        "transformers": bench_transformers,
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
                    r = others[name](path, prompt_len)
            except Exception as e:  # one engine failing must not lose the other's numbers
                r = {"error": f"{type(e).__name__}: {e}"}
            r.update(engine=name, prompt=prompt_len, cache_type=cache_type)
            if bandwidth and _measured(r):
                bytes_per_token = result_bytes_per_token(r, shape, quantized_bytes)
                r.update(roofline_fields(r["decode_tok_s"], bytes_per_token, bandwidth))
            info["results"].append(r)
            print(json.dumps(r), flush=True)
    if args.concurrency:
        try:
            info["concurrency"] = bench_concurrency(path, args.concurrency)
        except Exception as e:  # keep the per-engine numbers (and write them)
            info["concurrency_error"] = f"{type(e).__name__}: {e}"
            print(f"concurrency: {info['concurrency_error']}", flush=True)
    if args.constrained:
        from tools.bench_constrained import bench_constrained

        try:
            info["constrained"] = bench_constrained(path, Path(args.constrained))
            print(json.dumps(info["constrained"]), flush=True)
        except Exception as e:  # keep the other numbers (and write them)
            info["constrained_error"] = f"{type(e).__name__}: {e}"
            print(f"constrained: {info['constrained_error']}", flush=True)
    info["ratios"] = ratios_vs_exllamav2(info["results"])
    print("\n".join(summary_lines(info)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(info, indent=1))
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot and plot_results(info, Path(plot)):
        print(f"plot: {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
