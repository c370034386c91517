"""tools/bench.py on the CPU: the roofline arithmetic on hand-computed numbers, the pairing of
Kestrel with exllamav2, the plot, and the transformers model built from Kestrel's weights
(same logits as Kestrel, and the decode loop runs)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tools import bench

TINY = bench.SHAPES["tiny"]  # hidden 512, 4 layers, 8 heads of 64, 2 KV heads, vocab 4096


def test_param_count_by_hand_and_against_transformers() -> None:
    # Per layer: q, o 512*512 each; k, v 512*128 each; gate, up, down 512*1408 each; 2 norms.
    per_layer = 2 * 512 * 512 + 2 * 512 * 128 + 3 * 512 * 1408 + 2 * 512
    assert per_layer == 2_819_072
    assert bench.llama_param_count(TINY) == 4 * per_layer + 2 * 4096 * 512 + 512 == 15_471_104
    assert bench.llama_param_count(bench.SHAPES["llama3-8b"]) == 8_030_261_248
    assert bench.llama_param_count({**TINY, "tie_word_embeddings": True}) == 15_471_104 - 2_097_152

    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    assert sum(p.numel() for p in model.parameters()) == bench.llama_param_count(TINY)


def test_weight_bytes_per_token() -> None:
    sizes = {
        "model.embed_tokens.weight": 1000 * 8 * 2,  # vocab 1000, hidden 8, fp16
        "model.layers.0.mlp.down_proj.qweight": 500,
        "model.layers.0.mlp.down_proj.scales": 40,
        "model.norm.weight": 16,
        "lm_head.qweight": 4000,
    }
    # Everything but the embedding table, plus one of its 1000 rows (16 bytes).
    assert bench.weight_bytes_per_token(sizes, 1000) == 500 + 40 + 16 + 4000 + 16
    # Without a head tensor the head is the embedding table: all of it is read.
    del sizes["lm_head.qweight"]
    assert bench.weight_bytes_per_token(sizes, 1000) == 500 + 40 + 16 + 16000
    # FP16: 2 bytes per parameter, one embedding row of 512.
    assert bench.fp16_weight_bytes_per_token(TINY) == 2 * (15_471_104 - 4095 * 512) == 26_748_928


def test_kv_bytes_read() -> None:
    # fp16: K and V * 4 layers * 2 KV heads * 64 dims * 2 bytes, per token of context.
    assert bench.kv_bytes_read(512, TINY) == 512 * 2 * 4 * 2 * 64 * 2 == 1_048_576
    # q8 at head_dim 64: 64 code bytes + 2 fp16 scales (groups of 32) = 68, padded to 80.
    assert bench.kv_bytes_read(512, TINY, "q8") == 512 * 2 * 4 * 2 * 80 == 655_360
    # q4: 32 code bytes + 4 scale bytes = 36, padded to 48.
    assert bench.kv_bytes_read(512, TINY, "q4") == 512 * 2 * 4 * 2 * 48 == 393_216
    # Llama 3 8B at 8192 tokens in fp16: exactly 1 GiB.
    assert bench.kv_bytes_read(8192, bench.SHAPES["llama3-8b"]) == 2**30


def test_bytes_per_token_and_roofline() -> None:
    weights = 4_000_000 - 1_048_576  # with the fp16 cache at 512 tokens: 4,000,000 in all
    kestrel = {"engine": "kestrel", "prompt": 512, "cache_type": "fp16"}
    assert bench.result_bytes_per_token(kestrel, TINY, weights) == 4_000_000
    q4 = {**kestrel, "cache_type": "q4"}
    assert bench.result_bytes_per_token(q4, TINY, weights) == weights + 393_216
    # exllamav2 keeps an fp16 cache whatever the row says; same files as Kestrel.
    exl2 = {"engine": "exllamav2", "prompt": 512, "cache_type": "q4"}
    assert bench.result_bytes_per_token(exl2, TINY, weights) == 4_000_000
    hf = {"engine": "transformers", "prompt": 512, "cache_type": "fp16"}
    assert bench.result_bytes_per_token(hf, TINY, weights) == 26_748_928 + 1_048_576

    fields = bench.roofline_fields(250_000.0, 4_000_000, 2e12)  # 2 TB/s
    assert fields == {
        "bytes_per_token": 4_000_000,
        "roofline_tok_s": 500_000.0,
        "fraction_of_roofline": 0.5,
    }


def _row(engine: str, prompt: int, decode: float, prefill: float, cache: str = "fp16") -> dict:
    return {
        "engine": engine,
        "prompt": prompt,
        "cache_type": cache,
        "decode_tok_s": decode,
        "prefill_tok_s": prefill,
        "vram_gib": 5.0,
        "load_s": 2.0,
    }


RESULTS = [
    _row("kestrel", 512, 150.0, 9000.0),
    _row("kestrel", 512, 300.0, 1.0, cache="q4"),  # other cache types are not compared
    _row("exllamav2", 512, 120.0, 10000.0),
    _row("transformers", 512, 40.0, 5000.0),
    _row("exllamav2", 2048, 100.0, 8000.0),
    _row("kestrel", 2048, 110.0, 8800.0),
    {"engine": "exllamav2", "prompt": 8192, "cache_type": "fp16", "error": "OOM"},
    _row("kestrel", 8192, 90.0, 7000.0),  # no exllamav2 number to compare with
]


def test_ratios_pair_kestrel_fp16_with_exllamav2_at_the_same_prompt() -> None:
    assert bench.ratios_vs_exllamav2(RESULTS) == [
        {"prompt": 512, "decode": 150.0 / 120.0, "prefill": 9000.0 / 10000.0},
        {"prompt": 2048, "decode": 110.0 / 100.0, "prefill": 8800.0 / 8000.0},
    ]


def _info() -> dict:
    results = [dict(r) for r in RESULTS]
    for r in results:
        if "error" not in r:
            r.update(bench.roofline_fields(r["decode_tok_s"], 10_000_000_000, 3.0e12))
    return {
        "gpu": "NVIDIA H100 80GB HBM3",
        "torch": "2.x",
        "triton": "3.x",
        "shape": "llama3-8b",
        "format": "gptq",
        "new_tokens": 128,
        "read_bandwidth_gb_s": 3000.0,
        "results": results,
        "concurrency": [
            {"engine": "kestrel", "concurrency": n, "aggregate_tok_s": t}
            for n, t in [(1, 150.0), (8, 1000.0), (32, 3000.0), (64, 4500.0)]
        ],
    }


def test_summary_shows_ratios_roofline_and_errors() -> None:
    lines = bench.summary_lines(_info())
    assert lines[0].startswith("NVIDIA H100 80GB HBM3, torch 2.x, triton 3.x, llama3-8b gptq")
    kestrel_512 = lines[1]
    assert "decode   150.0 tok/s" in kestrel_512
    assert "vs exllamav2: decode 1.25x prefill 0.90x" in kestrel_512
    assert "roofline    300 (50%)" in kestrel_512  # 3e12 / 1e10 bytes
    assert "vs exllamav2" not in lines[3]  # exllamav2's own row
    assert "vs exllamav2: decode 0.33x prefill 0.50x" in lines[4]  # transformers
    assert lines[7].endswith("OOM")
    assert "vs exllamav2" not in lines[8]
    assert lines[-1].split() == ["kestrel", "64", "jobs", "aggregate", "4500", "tok/s"]


def test_plot_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "out" / "run.png"
    assert bench.plot_results(_info(), path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    # One prompt and no concurrency still make a plot.
    single = {**_info(), "results": _info()["results"][:4]}
    del single["concurrency"]
    assert bench.plot_results(single, tmp_path / "single.png")
    assert (tmp_path / "single.png").stat().st_size > 10_000


@pytest.mark.parametrize("fmt", ["gptq", "exl2"])
def test_transformers_model_matches_kestrel(tmp_path, monkeypatch, fmt: str) -> None:
    """The transformers model built from Kestrel's dequantized weights computes Kestrel's
    logits (fp32 on the CPU), and the benchmark's decode loop runs through its cache."""
    from engine.engine import Engine, EngineOptions

    path = bench.build_model(tmp_path / fmt, "tiny", fmt, device="cpu")
    sizes = bench.model_tensor_bytes(path)
    assert sizes["model.embed_tokens.weight"] == 4096 * 512 * 2
    assert bench.weight_bytes_per_token(sizes, 4096) == sum(sizes.values()) - 4095 * 512 * 2

    model = bench.build_transformers_model(path, "cpu", torch.float32)
    ids = torch.randint(2, TINY["vocab_size"], (12,), generator=torch.Generator().manual_seed(1))
    engine = Engine.load(path, EngineOptions(device="cpu", dtype="float32", max_seq_len=64))
    try:
        expected = engine.logits(ids.tolist()).float()
    finally:
        engine.unload()
    with torch.inference_mode():
        logits = model(input_ids=ids[None]).logits[0].float()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)

    monkeypatch.setattr(bench, "NEW_TOKENS", 3)
    decode, prefill = bench._transformers_speeds(model, ids[None])
    assert decode > 0 and prefill > 0


def test_scheduler_decode_speed_runs_one_job_through_the_scheduler(tmp_path, monkeypatch):
    """The serving path's decode measure: one job's tokens after its first, timed from the
    first token's event; the summary shows it beside the synchronous loop's figure."""
    from engine.engine import Engine, EngineOptions

    path = bench.build_model(tmp_path / "gptq", "tiny", "gptq", device="cpu")
    engine = Engine.load(path, EngineOptions(device="cpu", dtype="float32", max_seq_len=64))
    monkeypatch.setattr(bench, "NEW_TOKENS", 4)
    submitted = []
    real_submit = engine.scheduler.submit

    def submit(prompt, settings):
        submitted.append(settings["max_new_tokens"])
        return real_submit(prompt, settings)

    monkeypatch.setattr(engine.scheduler, "submit", submit)
    try:
        assert bench.scheduler_decode_tok_s(engine, [5, 6, 7, 8]) > 0
    finally:
        engine.unload()
    assert submitted == [4] * 7  # 2 warm-ups and 5 timed runs
    info = _info()
    info["results"][0]["scheduler_decode_tok_s"] = 171.5
    assert "scheduler decode   171.5 tok/s" in bench.summary_lines(info)[1]


@pytest.mark.parametrize("fmt", ["gptq", "exl2"])
def test_random_weights_have_mean_zero(fmt: str) -> None:
    """Codes 1..15 around the zero point 8 (EXL2's implicit one too): weights of mean zero,
    whose outputs do not share a part that grows with the width layer by layer (with codes
    0..15 a 70B model's fp16 residual overflowed)."""
    from engine.quant.exl2 import Exl2Tensors, exl2_to_runtime
    from engine.quant.gptq import GptqTensors, gptq_to_runtime
    from kernels.quant_matmul import dequantize_reference

    gen = torch.Generator().manual_seed(0)
    packed = bench._random_quantized(fmt, 512, 256, False, gen, None, "cpu")
    if fmt == "gptq":
        qw = gptq_to_runtime(GptqTensors.from_dict(packed, bits=4, checkpoint_format="gptq"))
    else:
        qw = exl2_to_runtime(Exl2Tensors.from_dict(packed))
    codes = torch.cat([segment.codes() for segment in qw.segments])
    assert int(codes.min()) == 1 and int(codes.max()) == 15
    w = dequantize_reference(qw)
    # The mean is a few standard errors of zero (it was -scale/2, ~9 errors, before).
    assert abs(float(w.mean())) < 3 * float(w.std()) / w.numel() ** 0.5


@pytest.mark.parametrize("head_bits", [4, 6])
def test_exl2_head_bits_reach_the_written_head(tmp_path, head_bits: int) -> None:
    """--exl2-head-bits: the EXL2 model's head has those bits in every group (4 compares it
    with GPTQ's 4-bit head at the same bits), its layers stay 4-bit."""
    from safetensors.torch import load_file

    path = bench.build_model(tmp_path / "m", "tiny", "exl2", device="cpu", exl2_head_bits=head_bits)
    tensors: dict = {}
    for shard in path.glob("*.safetensors"):
        tensors.update(load_file(shard))

    def bits(name: str) -> set[int]:
        return set(tensors[f"{name}.q_groups"][0::2].tolist())

    assert bits("lm_head") == {head_bits}
    assert bits("model.layers.0.mlp.down_proj") == {4}


def test_constrained_bench_runs_on_a_tiny_model(tmp_path, monkeypatch):
    """tools/bench.py --constrained's measurement, on the CPU with a tiny random model and
    SmolLM2's tokenizer: every number is there and the constrained jobs produced tokens."""
    from loader.default_model import DEFAULT_MODEL, ensure_packaged_model
    from tools.bench_constrained import bench_constrained

    # The tiny shape with SmolLM2's vocabulary size, so that its tokenizer fits the head.
    monkeypatch.setitem(bench.SHAPES, "tiny-49k", {**bench.SHAPES["tiny"], "vocab_size": 49152})
    model = bench.build_model(tmp_path / "tiny", "tiny-49k", "gptq", device="cpu")
    tokenizer = ensure_packaged_model(DEFAULT_MODEL, None, quiet=True)
    out = bench_constrained(model, tokenizer, 16, new_tokens=4, jobs=2, device="cpu")
    for key in ("batch1_free_tok_s", "batch1_constrained_tok_s", "jobs64_free_tok_s",
                "jobs64_half_constrained_tok_s", "batch1_ratio", "jobs64_ratio"):  # fmt: skip
        assert out[key] > 0, (key, out)
    assert out["vocab"] == 49152


def test_mask_bench_runs_its_variants_in_lockstep(tmp_path, capsys):
    """tools/bench_masks.py on SmolLM2's tokenizer: the three mask paths (before, finer
    slices, two lanes) give equal masks step after step (the tool raises otherwise) and
    every time is reported, cold and warm; its command line writes the JSON."""
    from loader.default_model import DEFAULT_MODEL, ensure_packaged_model
    from tools import bench_masks

    tokenizer = ensure_packaged_model(DEFAULT_MODEL, None, quiet=True)
    out = tmp_path / "masks.json"
    args = ["--tokenizer", str(tokenizer), "--rows", "4", "--steps", "12", "--episodes", "2"]
    assert bench_masks.main([*args, "--lanes", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["rows"], result["steps"], result["lanes"]) == (4, 12, 2)
    for name in bench_masks.VARIANTS:
        for phase in ("cold", "warm", "consume"):
            assert result[name][phase]["mean_ms"] > 0, (name, phase)
    assert re.search(r"before +warm", capsys.readouterr().out)
    with pytest.raises(SystemExit):
        bench_masks.main(["--tokenizer", str(tmp_path)])  # no tokenizer.json there
