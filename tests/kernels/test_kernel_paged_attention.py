"""kernels.attention.paged_attention: the Triton decode and prefill kernels against the
torch reference on random caches with shuffled pages, argument checks, and the dispatcher.

On CPU the kernels run in the Triton interpreter, so shapes stay tiny there; the `gpu`
tests run Llama-3-8B-sized cases (and print timings with `pytest -s`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import pytest
import torch

from kernels.attention import (
    paged_attention,
    paged_attention_reference,
    paged_attention_triton,
)
from kernels.attention.decode import plan_splits
from kernels.backend import resolve_backend

# The dispatcher's module, for monkeypatching the kernels it calls.
pa_module = importlib.import_module("kernels.attention.paged")
decode_module = importlib.import_module("kernels.attention.decode")

# The kernels loop over runtime key ranges; Triton 3.6's interpreter turns such loop bounds
# into ints from 1-element arrays, which numpy 2.x deprecates (and 2.4 rejects, hence the
# numpy<2.4 pin in requirements.txt; triton-lang/triton#9171).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
NO_SPLIT = 1 << 30  # keys per decode split: larger than any context, so one split


def _require_triton(device: str) -> None:
    # One process is either interpreted or compiled (triton.jit decides at import): on a GPU
    # machine the interpreter is off, so the Triton path cannot take CPU tensors there.
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (unset on GPU machines)")


def _batch(
    seqs: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    *,
    page_size: int = 16,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, cu_seqlens, context_lens, page_table) for sequences given as
    (tokens already cached, new tokens), on shuffled pages with spare pages between them."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-(prior + new) // page_size) for prior, new in seqs]
    num_pages = 2 * sum(pages_per_seq) + 1
    order = torch.randperm(num_pages, generator=generator)
    table = torch.zeros(len(seqs), max(max(pages_per_seq, default=1), 1), dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages_per_seq):
        table[b, :count] = order[used : used + count]
        used += count
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator)
    v_cache = torch.randn(shape, generator=generator)
    num_tokens = sum(new for _, new in seqs)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=generator)
    cu = [0]
    for _, new in seqs:
        cu.append(cu[-1] + new)
    return (
        q.to(device, dtype),
        k_cache.to(device, dtype),
        v_cache.to(device, dtype),
        torch.tensor(cu, dtype=torch.int32, device=device),
        torch.tensor([p + n for p, n in seqs], dtype=torch.int32, device=device),
        table.to(device),
    )


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    error = _relative_error(out, ref)
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


# (Hq, Hk, D): GQA ratios 1, 4, 8; head dims that are not powers of two.
HEADS = [(4, 4, 64), (8, 2, 80), (16, 2, 96)]
DECODE_SEQS = [(0, 1), (16, 1), (39, 1)]  # contexts of 1, 17 and 40 tokens
HALF_DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "Hq{}-Hk{}-D{}".format(*h))
def test_decode_matches_reference(
    device: str, heads: tuple[int, int, int], dtype: torch.dtype, split: bool
) -> None:
    _require_triton(device)
    args = _batch(DECODE_SEQS, *heads, dtype, device)
    scale = heads[2] ** -0.5
    ref = paged_attention_reference(*args, scale=scale)
    # 16 keys per split: the 40-token context runs as 3 splits merged by log-sum-exp.
    out = paged_attention_triton(
        *args, scale=scale, max_query_len=1, decode_split_tokens=16 if split else NO_SPLIT
    )
    _check(out, ref, dtype)


@pytest.mark.parametrize(
    ("heads", "dot"),
    [((8, 4, 64), True), ((16, 2, 64), False)],
    ids=["G2-dot", "G8-broadcast"],
)
def test_decode_other_tile_path(device: str, heads: tuple[int, int, int], dot: bool) -> None:
    # Each group size has a default tile path; force the other one.
    _require_triton(device)
    args = _batch(DECODE_SEQS, *heads, torch.float16, device, seed=1)
    ref = paged_attention_reference(*args, scale=0.125)
    out = paged_attention_triton(*args, scale=0.125, decode_split_tokens=16, decode_dot=dot)
    _check(out, ref, torch.float16)


@pytest.mark.parametrize(
    ("window", "softcap"), [(10, None), (None, 5.0), (25, 20.0)], ids=["window", "cap", "both"]
)
@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_decode_window_and_softcap(
    device: str, window: int | None, softcap: float | None, split: bool
) -> None:
    _require_triton(device)
    dtype = torch.bfloat16
    args = _batch(DECODE_SEQS, 8, 2, 64, dtype, device, seed=2)
    kwargs = dict(scale=0.3, sliding_window=window, softcap=softcap)
    ref = paged_attention_reference(*args, **kwargs)
    out = paged_attention_triton(*args, **kwargs, decode_split_tokens=16 if split else NO_SPLIT)
    _check(out, ref, dtype)


# Chunks of 1, 5 and 33 tokens; two start past position 0 (chunked prefill), one after 70
# cached tokens so that whole key blocks precede the diagonal.
PREFILL_SEQS = [(20, 1), (0, 5), (70, 33)]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "Hq{}-Hk{}-D{}".format(*h))
def test_prefill_matches_reference(
    device: str, heads: tuple[int, int, int], dtype: torch.dtype
) -> None:
    _require_triton(device)
    args = _batch(PREFILL_SEQS, *heads, dtype, device, seed=3)
    scale = heads[2] ** -0.5
    ref = paged_attention_reference(*args, scale=scale)
    out = paged_attention_triton(*args, scale=scale)
    _check(out, ref, dtype)


@pytest.mark.parametrize(
    ("window", "softcap"), [(24, None), (None, 20.0), (9, 5.0)], ids=["window", "cap", "both"]
)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_prefill_window_and_softcap(
    device: str, dtype: torch.dtype, window: int | None, softcap: float | None
) -> None:
    # A window shorter than the 33-token chunk: rows of one tile see different key ranges.
    _require_triton(device)
    args = _batch(PREFILL_SEQS, 8, 2, 80, dtype, device, seed=4)
    kwargs = dict(scale=0.2, sliding_window=window, softcap=softcap)
    ref = paged_attention_reference(*args, **kwargs)
    out = paged_attention_triton(*args, **kwargs)
    _check(out, ref, dtype)


def test_float32(device: str) -> None:
    _require_triton(device)
    for seqs in (DECODE_SEQS, PREFILL_SEQS):
        args = _batch(seqs, 8, 2, 64, torch.float32, device, seed=5)
        ref = paged_attention_reference(*args, scale=0.125, softcap=10.0)
        out = paged_attention_triton(*args, scale=0.125, softcap=10.0, decode_split_tokens=16)
        _check(out, ref, torch.float32)


def test_mixed_batch_with_empty_sequences(device: str) -> None:
    # Decode tokens, an idle sequence and a chunk in one launch (continuous batching), and a
    # decode step where one sequence sits idle.
    _require_triton(device)
    dtype = torch.float16
    args = _batch([(30, 1), (12, 0), (3, 9), (50, 1)], 4, 2, 64, dtype, device, seed=6)
    ref = paged_attention_reference(*args, scale=0.125)
    _check(paged_attention_triton(*args, scale=0.125), ref, dtype)

    args = _batch([(30, 1), (12, 0), (50, 1)], 4, 2, 64, dtype, device, seed=7)
    ref = paged_attention_reference(*args, scale=0.125)
    out = paged_attention_triton(*args, scale=0.125, max_query_len=1, decode_split_tokens=16)
    _check(out, ref, dtype)


def test_split_merge_in_the_last_split_is_exact_and_repeatable(device: str) -> None:
    """The last split of each (sequence, kv head) to finish merges the group's splits: the
    result matches the reference for groups of 1, 4 and 8 query heads over many splits
    (merged a chunk at a time), with an idle sequence in the batch; a second call gives
    the same bits, and the counters are zero again after each call."""
    _require_triton(device)
    dtype = torch.float16
    for heads, kv_heads in ((2, 2), (8, 2), (16, 2)):
        args = _batch([(600, 1), (12, 0), (77, 1)], heads, kv_heads, 64, dtype, device, seed=9)
        ref = paged_attention_reference(*args, scale=0.125)
        runs = [
            paged_attention_triton(*args, scale=0.125, max_query_len=1, decode_split_tokens=16)
            for _ in range(2)
        ]
        _check(runs[0], ref, dtype)
        assert torch.equal(runs[0], runs[1])
        counters = decode_module._COUNTERS[torch.device(device)]
        assert int(counters.count_nonzero()) == 0


def test_page_sizes_and_context_bounds(device: str) -> None:
    # Pages larger than a key block, and a max_context_len below the truth: the last split
    # takes the rest, so a wrong bound costs speed, not keys.
    _require_triton(device)
    dtype = torch.float16
    args = _batch([(0, 1), (16, 1), (149, 1)], 4, 2, 64, dtype, device, page_size=128, seed=8)
    ref = paged_attention_reference(*args, scale=0.125)
    # Splits of 64 keys (one key block): 3 cover the contexts, 2 and 1 fall short.
    for bound in (150, 70, 16):
        out = paged_attention_triton(
            *args, scale=0.125, max_query_len=1, max_context_len=bound, decode_split_tokens=16
        )
        _check(out, ref, dtype)


def test_split_plan_goes_down_to_one_key_block() -> None:
    # One sequence of 8 KV heads at a 656-key bound on 132 SMs: splits of one 64-key block
    # (11 of them), so a short context is not left to two programs walking blocks in turn.
    assert plan_splits(1, 8, 656, 132, 64) == (11, 64)
    # Long contexts still stop near the programs per SM wanted: 43 splits of 3 blocks.
    assert plan_splits(1, 8, 8208, 132, 64) == (43, 192)
    # A full batch needs no split at all.
    assert plan_splits(64, 8, 8208, 132, 64) == (1, 8256)


def test_splits_of_a_few_blocks(device: str) -> None:
    # On the interpreter (2 "SMs") one sequence of 1000 keys and 1 KV head plans 6 splits
    # of 192 keys (3 blocks of 64 each, merged by the last split), against the reference.
    _require_triton(device)
    assert plan_splits(1, 1, 1000, 2, 64) == (6, 192)
    dtype = torch.float16
    args = _batch([(999, 1)], 8, 1, 64, dtype, device, seed=3)
    ref = paged_attention_reference(*args, scale=0.125)
    sms = 2 if device == "cpu" else torch.cuda.get_device_properties(0).multi_processor_count
    # A bound whose plan has splits of several blocks here (1000 keys) and on any GPU of
    # 43+ SMs (128 splits of 192 keys); the kernel spreads the 1000 real keys over them.
    bound = 1000 if device == "cpu" else 192 * 128
    num_splits, split_tokens = plan_splits(1, 1, bound, sms, 64)
    assert num_splits > 1 and split_tokens > 64
    out = paged_attention_triton(*args, scale=0.125, max_query_len=1, max_context_len=bound)
    _check(out, ref, dtype)


def test_short_contexts_under_a_long_plan(device: str) -> None:
    # A decode graph plans its splits for the longest context it serves; the kernel spreads
    # each sequence's actual keys over those splits (one block each here, the rest empty).
    _require_triton(device)
    dtype = torch.float16
    args = _batch([(0, 1), (70, 1), (200, 1)], 8, 2, 64, dtype, device, seed=9)
    ref = paged_attention_reference(*args, scale=0.125)
    # 256 keys per planned split: 16, 2 and 1 splits for these bounds.
    for bound in (4096, 512, 201):
        out = paged_attention_triton(
            *args, scale=0.125, max_query_len=1, max_context_len=bound, decode_split_tokens=256
        )
        _check(out, ref, dtype)


def test_strided_q(device: str) -> None:
    # q as the engine gets it from a fused QKV projection: rows strided by the QKV width.
    _require_triton(device)
    dtype = torch.float16
    q, k_cache, v_cache, cu, lens, table = _batch(PREFILL_SEQS, 4, 2, 64, dtype, device)
    qkv = torch.cat([q, torch.zeros_like(q)], dim=1)
    q_view = qkv[:, :4]
    assert not q_view.is_contiguous()
    ref = paged_attention_reference(q, k_cache, v_cache, cu, lens, table, scale=0.125)
    out = paged_attention_triton(q_view, k_cache, v_cache, cu, lens, table, scale=0.125)
    _check(out, ref, dtype)


def test_empty_batch(device: str) -> None:
    _require_triton(device)
    args = _batch([(5, 0)], 4, 2, 64, torch.float16, device)
    for backend in ("torch", "triton"):
        out = paged_attention(*args, scale=0.125, backend=backend)
        assert out.shape == (0, 4, 64)


def _bad(name: str) -> tuple[list[torch.Tensor], dict[str, object]]:
    q, k_cache, v_cache, cu, lens, table = _batch(DECODE_SEQS, 4, 2, 64, torch.float16, "cpu")
    kwargs: dict[str, object] = {"scale": 0.125}
    if name == "heads":
        q = q[:, :3]
    elif name == "head dim":
        q = q[..., :32]
    elif name == "cache dtype":
        k_cache, v_cache = k_cache.float(), v_cache.float()
    elif name == "cache shapes":
        v_cache = v_cache[:2]
    elif name == "batch":
        lens = lens[:2]
    elif name == "index dtype":
        cu = cu.float()
    elif name == "window":
        kwargs["sliding_window"] = 0
    return [q, k_cache, v_cache, cu, lens, table], kwargs


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("heads", "not a multiple"),
        ("head dim", "differs from the cache"),
        ("cache dtype", "cache dtype must be"),
        ("cache shapes", "must both be"),
        ("batch", "expected cu_seqlens"),
        ("index dtype", "int32 or int64"),
        ("window", "sliding_window"),
    ],
)
def test_triton_rejects_bad_arguments(device: str, name: str, message: str) -> None:
    _require_triton(device)
    tensors, kwargs = _bad(name)
    with pytest.raises(ValueError, match=message):
        paged_attention(*(t.to(device) for t in tensors), **kwargs, backend="triton")


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _batch(DECODE_SEQS, 4, 2, 64, torch.float16, "cpu")
    ref = paged_attention_reference(*args, scale=0.125)

    def triton_called(*a: object, **k: object) -> torch.Tensor:
        raise AssertionError("backend='auto' ran the Triton kernel on CPU tensors")

    with monkeypatch.context() as patch:
        patch.setattr(pa_module, "paged_attention_triton", triton_called)
        assert resolve_backend("auto", *args) == "torch"
        assert torch.equal(paged_attention(*args, scale=0.125, max_query_len=1), ref)

    # Decode or prefill: read from cu_seqlens, or taken from max_query_len.
    device = "cuda" if torch.cuda.is_available() else "cpu"  # conftest: cpu is interpreted
    args = tuple(t.to(device) for t in args)
    ref = ref.to(device)
    calls: list[str] = []
    real_decode, real_prefill = pa_module.decode_attention, pa_module.prefill_attention

    def decode(*a: object, **k: object) -> torch.Tensor:
        calls.append("decode")
        return real_decode(*a, **k)

    def prefill(*a: object, **k: object) -> torch.Tensor:
        calls.append("prefill")
        return real_prefill(*a, **k)

    monkeypatch.setattr(pa_module, "decode_attention", decode)
    monkeypatch.setattr(pa_module, "prefill_attention", prefill)
    _check(paged_attention(*args, scale=0.125, backend="triton"), ref, torch.float16)
    _check(
        paged_attention(*args, scale=0.125, max_query_len=2, backend="triton"), ref, torch.float16
    )
    assert calls == ["decode", "prefill"]


# --- GPU: realistic shapes (Llama-3-8B attention: Hq 32, Hk 8, D 128; engine pages of 256).


def _time_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_decode_realistic(batch: int, dtype: torch.dtype) -> None:
    contexts = [8192, 611, 4096, 1, 7000, 256, 2048, 8191][:batch]
    args = _batch([(c - 1, 1) for c in contexts], 32, 8, 128, dtype, "cuda", page_size=256)
    ref = paged_attention_reference(*args, scale=128**-0.5)
    kwargs = dict(scale=128**-0.5, max_query_len=1, max_context_len=max(contexts))
    out = paged_attention(*args, **kwargs)
    _check(out, ref, dtype)
    ms = _time_ms(lambda: paged_attention(*args, **kwargs))
    kv_bytes = 2 * sum(contexts) * 8 * 128 * args[1].element_size()
    print(f"\ndecode B={batch} {dtype}: {ms * 1e3:.1f} us, {kv_bytes / ms / 1e6:.0f} GB/s of K/V")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_gpu_prefill_realistic(dtype: torch.dtype) -> None:
    # One 2048-token prompt, and a 512-token chunk after 3000 cached tokens beside it.
    seqs = [(0, 2048), (3000, 512)]
    args = _batch(seqs, 32, 8, 128, dtype, "cuda", page_size=256)
    ref = paged_attention_reference(*args, scale=128**-0.5)
    out = paged_attention(*args, scale=128**-0.5, max_query_len=2048)
    _check(out, ref, dtype)
    ms = _time_ms(lambda: paged_attention(*args, scale=128**-0.5, max_query_len=2048))
    # Causal FLOPs: 4 * D * Hq per (query, visible key) pair.
    pairs = sum(n * p + n * (n + 1) // 2 for p, n in seqs)
    print(f"\nprefill {dtype}: {ms * 1e3:.0f} us, {4 * 128 * 32 * pairs / ms / 1e9:.0f} TFLOP/s")


@pytest.mark.gpu
@pytest.mark.parametrize("seqs", [[(4000, 1), (100, 1)], [(3000, 300), (0, 1)]], ids=["dec", "pre"])
def test_gpu_gemma_head_dim_256(seqs: list[tuple[int, int]]) -> None:
    # Gemma-2: D 256, softcap 50, window 4096 (here 1024 to make it bite).
    dtype = torch.bfloat16
    args = _batch(seqs, 8, 4, 256, dtype, "cuda", page_size=256)
    kwargs = dict(scale=256**-0.5, sliding_window=1024, softcap=50.0)
    ref = paged_attention_reference(*args, **kwargs)
    _check(paged_attention(*args, **kwargs), ref, dtype)
