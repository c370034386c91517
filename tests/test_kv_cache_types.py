"""KV cache storage types (fp16, fp8, q8, q6, q4): the quantize-on-write kernel against its
torch reference, round trips, the paged attention kernels over quantized pages against dense
attention over the dequantized K/V (and within a stated distance of fp16), and the engine
end to end with every type.

On CPU the Triton kernels run in the interpreter, so shapes stay tiny.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.cache import CACHE_TYPES, PagedKVCache, cache_bytes_per_token
from engine.engine import Engine, EngineOptions
from engine.generate import generate_single
from kernels.attention import (
    paged_attention,
    paged_attention_reference,
    paged_attention_triton,
)
from kernels.kv_quant import (
    FP8_MAX,
    KVFormat,
    cache_formats,
    dequantize_rows,
    hadamard,
    kv_cache_write,
    quantize_rows,
    rotate,
)
from tools.perplexity import main as perplexity_main

from model_factory import CORPUS, make_tiny_llama

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)
QUANTIZED = ["fp8", "q8", "q6", "q4"]
KINDS = ["fp8", "int8", "int6", "int4"]
# Output of attention over a quantized cache against the same attention over the float32
# cache: relative L2 error over random unit-normal K/V with an outlier channel in K
# (measured over CASES: fp8 2.8-3.4 %, q8 0.5-0.8 %, q6 2.2-3.0 %, q4 9.6-11.7 %).
DISTANCE_FROM_FP16 = {"fp8": 0.05, "q8": 0.015, "q6": 0.05, "q4": 0.18}


def _require_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (unset on GPU machines)")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# -- formats and the write op ----------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 64, 96])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_write_kernel_matches_reference(device: str, kind: str, dtype, head_dim: int) -> None:
    _require_triton(device)
    fmt = KVFormat(kind)
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(6, 2, head_dim, generator=gen) * 3
    x[0, 0, 3] = 60.0  # an outlier
    x[1, 1] = 0.0  # an all-zero row: scale 0, codes of 0
    x[2, 0, :] = torch.linspace(-1e-3, 1e-3, head_dim)  # fp8 subnormals without the scale
    x = x.to(device, dtype)
    slots = torch.tensor([0, 5, 6, 9, 2, 11], device=device)
    shape = (3, 4, 2, fmt.row_bytes(head_dim))
    ref = torch.zeros(shape, dtype=torch.uint8, device=device)
    out = torch.full(shape, 7, dtype=torch.uint8, device=device)
    kv_cache_write(x, ref, slots, fmt, backend="torch")
    kv_cache_write(x, out, slots, fmt, backend="triton")
    data = fmt.data_bytes(head_dim)  # the padding after it is never read
    written = ref.view(-1, 2, shape[-1])[slots][..., :data]
    if device == "cpu":
        assert torch.equal(out.view(-1, 2, shape[-1])[slots][..., :data], written)
    else:
        # A GPU may divide with an ulp of difference: a code can flip at an exact tie.
        differ = (out.view(-1, 2, shape[-1])[slots][..., :data] != written).float().mean()
        assert differ < 0.01
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert (out.view(-1, 2, shape[-1])[untouched.to(device)] == 7).all()


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(kind: str) -> None:
    fmt = KVFormat(kind)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=gen)
    x[:, 7] *= 20  # a channel outlier, as K has
    rotated = rotate(x, fmt.group_size(128)) if fmt.rotated else x
    rows = quantize_rows(rotated, fmt)
    assert rows.dtype == torch.uint8 and rows.shape == (64, fmt.row_bytes(128))
    back = dequantize_rows(rows, fmt, 128)
    if fmt.rotated:
        back = rotate(back, fmt.group_size(128))
    bound = {"fp8": 0.04, "int8": 0.01, "int6": 0.03, "int4": 0.12}[kind]
    assert _rel(back, x) < bound
    if kind == "fp8":
        # Codes are e4m3 of x / scale, the scale max|x| / 448 (float16) per row.
        scale = (x.abs().amax(1) / FP8_MAX).half().float()
        want = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        assert torch.equal(rows[:, :128], want.view(torch.uint8))
    else:
        # The element of largest magnitude in each group comes back exactly (its scale is
        # float16-rounded, hence the tolerance).
        g = fmt.group_size(128)
        groups, back_g = rotated.view(64, -1, g), dequantize_rows(rows, fmt, 128).view(64, -1, g)
        idx = groups.abs().argmax(-1, keepdim=True)
        torch.testing.assert_close(
            back_g.gather(-1, idx), groups.gather(-1, idx), rtol=1e-3, atol=0
        )
    assert torch.equal(
        dequantize_rows(quantize_rows(torch.zeros(2, 128), fmt), fmt, 128), torch.zeros(2, 128)
    )


def test_rotation_is_orthonormal_and_its_own_inverse() -> None:
    h = hadamard(32, torch.device("cpu"))
    torch.testing.assert_close(h @ h, torch.eye(32), atol=1e-6, rtol=0)
    x = torch.randn(5, 64)
    torch.testing.assert_close(rotate(rotate(x, 32), 32), x, atol=1e-5, rtol=0)
    # An outlier is spread over its group: that is what the int formats rotate for.
    spike = torch.zeros(1, 32)
    spike[0, 3] = 1.0
    assert rotate(spike, 32).abs().max() == pytest.approx(32**-0.5)


def test_unknown_type_and_odd_head_dim_are_refused() -> None:
    with pytest.raises(ValueError, match="available: fp16, fp8, q8, q6, q4"):
        cache_formats("q5")
    with pytest.raises(ValueError, match="multiple of 16"):
        PagedKVCache(
            num_layers=1, num_kv_heads=1, head_dim=24, num_pages=2, page_size=4,
            dtype=torch.float16, layer_devices=[torch.device("cpu")], cache_type="q4",
        )  # fmt: skip


def test_bytes_per_token() -> None:
    # Llama-3-8B: 32 layers, 8 kv heads of 128 dims.
    shape = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16)
    per = {t: cache_bytes_per_token(t, **shape) for t in CACHE_TYPES}
    heads = 32 * 8
    assert per["fp16"] == heads * 2 * 256
    # Codes and scales, each row padded to a multiple of 16 bytes (aligned loads).
    assert per["fp8"] == heads * 2 * 144  # 128 + 2
    assert per["q8"] == heads * 2 * 144  # 128 + 8
    assert per["q6"] == heads * 2 * 112  # 96 + 8
    assert per["q4"] == heads * 2 * 80  # 64 + 8
    assert per["q4"] < per["q6"] < per["fp8"] == per["q8"] < per["fp16"]


# -- attention over quantized pages ----------------------------------------------------------


def _quantized_batch(
    seqs: list[tuple[int, int]],
    heads: tuple[int, int, int],
    cache_type: str,
    device: str,
    *,
    page_size: int,
    seed: int,
    dtype: torch.dtype = torch.float16,
) -> tuple[tuple, tuple, dict]:
    """(args over the quantized cache, args over the float cache, format kwargs): random
    K/V written through `kv_cache_write` into shuffled pages."""
    num_q_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-(p + n) // page_size) for p, n in seqs]
    num_pages = 2 * sum(pages) + 1
    order = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(seqs), max(pages), dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[used : used + count]
        used += count
    k = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=gen)
    k[:, :, 1] *= 8  # an outlier channel in K
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_float, v_float = k.view(shape).to(device, dtype), v.view(shape).to(device, dtype)
    k_format, v_format = cache_formats(cache_type)
    slots = torch.arange(num_pages * page_size, device=device)
    caches = []
    for x, fmt in ((k, k_format), (v, v_format)):
        if fmt.quantized:
            cache = torch.zeros((*shape[:3], fmt.row_bytes(head_dim)), dtype=torch.uint8)
            cache = cache.to(device)
            kv_cache_write(x.to(device, dtype), cache, slots, fmt, backend="torch")
        else:
            cache = x.view(shape).to(device, dtype)
        caches.append(cache)
    q = torch.randn(sum(n for _, n in seqs), num_q_heads, head_dim, generator=gen)
    cu = torch.tensor([0] + [sum(n for _, n in seqs[: i + 1]) for i in range(len(seqs))])
    meta = (
        cu.to(device, torch.int32),
        torch.tensor([p + n for p, n in seqs], dtype=torch.int32, device=device),
        table.to(device),
    )
    q = q.to(device, dtype)
    formats = dict(k_format=k_format, v_format=v_format)
    return (q, *caches, *meta), (q, k_float, v_float, *meta), formats


CASES = [
    # (sequences (cached, new), (Hq, Hk, D), page size, window)
    ([(0, 1), (16, 1), (45, 1)], (8, 2, 64), 16, None),  # decode, GQA 4
    ([(30, 1), (7, 1)], (4, 4, 32), 8, 12),  # decode, MHA, sliding window
    ([(0, 9), (40, 20)], (8, 2, 64), 16, None),  # prefill chunks after cached tokens
    ([(20, 1), (25, 9)], (8, 1, 96), 32, 24),  # mixed, GQA 8, head dim 96, window
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("cache_type", QUANTIZED)
def test_paged_attention_over_quantized_cache(device: str, cache_type: str, case: int) -> None:
    _require_triton(device)
    seqs, heads, page_size, window = CASES[case]
    quant, floats, formats = _quantized_batch(
        seqs, heads, cache_type, device, page_size=page_size, seed=case
    )
    kwargs = dict(scale=heads[2] ** -0.5, sliding_window=window)
    dense = paged_attention_reference(*quant, **kwargs, **formats)
    out = paged_attention(*quant, **kwargs, **formats, backend="triton")
    assert out.shape == dense.shape and out.dtype == dense.dtype
    # Against dense attention over the dequantized K/V: the kernels' own float16 rounding.
    assert _rel(out, dense) < 4e-3
    # Against the unquantized cache: the storage type's cost.
    exact = paged_attention_reference(*floats, **kwargs)
    assert _rel(out, exact) < DISTANCE_FROM_FP16[cache_type]


def test_decode_split_k_over_quantized_cache(device: str) -> None:
    _require_triton(device)
    quant, _, formats = _quantized_batch(
        [(60, 1), (3, 1)], (8, 2, 64), "q6", device, page_size=16, seed=9
    )
    dense = paged_attention_reference(*quant, scale=0.125, **formats)
    out = paged_attention_triton(
        *quant, scale=0.125, max_query_len=1, decode_split_tokens=16, **formats
    )
    assert _rel(out, dense) < 4e-3


def test_attention_refuses_mismatched_storage() -> None:
    quant, floats, formats = _quantized_batch(
        [(3, 1)], (4, 2, 32), "q4", "cpu", page_size=8, seed=0
    )
    with pytest.raises(ValueError, match="uint8"):
        paged_attention_triton(*floats, scale=0.1, **formats)
    with pytest.raises(ValueError, match="cache dtype must be"):
        paged_attention_triton(*quant, scale=0.1)


# -- the engine with every cache type --------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-kv")
    make_tiny_llama(path, seed=3)
    return path


def _engine(path: Path, cache_type: str, **options) -> Engine:
    base = dict(
        device="cpu", dtype="float32", max_seq_len=128, page_size=8, cache_tokens=128,
        prefill_chunk=16, max_batch=4, cache_type=cache_type,
    )  # fmt: skip
    return Engine.load(path, EngineOptions(**{**base, **options}))


GREEDY = {"max_new_tokens": 8, "temperature": 0, "do_sample": False, "ban_eos_token": True}
PROMPT = [5, 17, 99, 3, 250, 41, 8, 77, 301, 12, 64, 200, 9, 31, 150, 6, 90, 45, 120, 7]


def _tokens(engine: Engine, prompt: list[int]) -> list[int]:
    return [t for e in generate_single(engine, prompt, GREEDY) for t in e.token_ids]


def test_generation_with_every_cache_type(model_dir: Path) -> None:
    fp16 = _engine(model_dir, "fp16")
    ref_logits = fp16.logits(PROMPT)
    ref_tokens = _tokens(fp16, PROMPT)
    assert len(ref_tokens) == 8
    for cache_type in QUANTIZED:
        engine = _engine(model_dir, cache_type)
        assert engine.cache.k[0].dtype == torch.uint8
        logits = engine.logits(PROMPT)
        # The storage type costs a little accuracy, never the model: logits stay close and
        # the top token of most positions agrees.
        assert _rel(logits, ref_logits) < {"fp8": 0.05, "q8": 0.02}.get(cache_type, 0.15)
        agree = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()
        assert agree >= 0.8
        tokens = _tokens(engine, PROMPT)
        assert len(tokens) == 8
        # Through the scheduler too: batched jobs equal single generations.
        jobs = [engine.scheduler.submit(p, GREEDY) for p in (PROMPT, PROMPT[:9])]
        events = list(engine.scheduler.stream_many(jobs))
        first = [t for e in events if e.job_id == jobs[0].id for t in e.token_ids]
        assert first == tokens
        assert engine.cache.free_pages == engine.cache.num_pages


def test_fp16_cache_is_unchanged(model_dir: Path) -> None:
    # The fp16 type stores K/V in the model's dtype exactly: logits equal a transformers
    # forward of the same weights (the architecture tests' bound).
    from transformers import AutoModelForCausalLM

    engine = _engine(model_dir, "fp16")
    assert engine.cache.k[0].dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(engine.logits(PROMPT), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_type", ["q4", "fp8"])
def test_prefix_cache_with_quantized_pages(model_dir: Path, cache_type: str) -> None:
    engine = _engine(model_dir, cache_type)
    prompt = PROMPT + PROMPT[:12]  # 32 tokens: 4 pages
    uncached = _tokens(engine, prompt)
    for _ in range(2):
        job = engine.scheduler.submit(prompt, GREEDY)
        ids = [t for e in engine.scheduler.stream(job) for t in e.token_ids]
        assert ids == uncached
    assert job.cached_tokens == 24  # the second run adopted the quantized pages


def test_unknown_cache_type_and_cache_gib(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown cache_type 'q5'.*fp16, fp8, q8, q6, q4"):
        _engine(model_dir, "q5")
    tokens = {}
    for cache_type in ("fp16", "q8", "q4"):
        engine = _engine(model_dir, cache_type, cache_tokens=None, cache_gib=2**-10)
        tokens[cache_type] = engine.cache.capacity_tokens
        assert (
            engine.cache.total_bytes
            <= 2**20 + engine.cache.page_size * engine.cache.bytes_per_token
        )
    assert tokens["fp16"] < tokens["q8"] < tokens["q4"]


def test_perplexity_tool_compares_cache_types(model_dir: Path, tmp_path: Path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text(" ".join(CORPUS), encoding="utf-8")
    args = ["-m", str(model_dir), "--text", str(text), "--window", "40", "--windows", "2"]
    perplexity_main([*args, "--no-bos", "--device", "cpu", "--cache-type", "fp16", "q4"])
    out = capsys.readouterr().out
    rows = [
        line for line in out.splitlines() if line.startswith("| fp16") or line.startswith("| q4")
    ]
    assert len(rows) == 2 and "+0.0000" in rows[0]
    fp16, q4 = (float(r.split("|")[2]) for r in rows)
    # The cache type reaches the measurement: q4 costs something, and not much.
    assert fp16 != q4 and abs(q4 / fp16 - 1) < 0.1
    # Chunked prefill reads the same quantized keys: the chunk size does not matter.
    chunked = perplexity_main([*args, "--no-bos", "--cache-type", "q4", "--prefill-chunk", "8"])
    assert chunked == pytest.approx(q4, rel=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_type", list(CACHE_TYPES))
def test_cuda_graph_decode_with_every_cache_type(model_dir: Path, cache_type: str) -> None:
    # Quantize-on-write and the rotations must be capturable: graph replay equals eager.
    options = dict(device="cuda", dtype="float16", cache_tokens=None)
    graphed = _engine(model_dir, cache_type, **options)
    eager = _engine(model_dir, cache_type, **options, cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    assert _tokens(graphed, PROMPT) == _tokens(eager, PROMPT)
