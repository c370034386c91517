"""Multi-token CUDA graphs (engine/cuda_graph.py): a step of B rows x T tokens, rows padded
at their end. On the CPU: the padded inputs that `stage_rows` writes, run through the
model, give the real tokens the logits of an unpadded forward and leave the cache as the
unpadded forward does. On a GPU: graph replays equal eager forwards, for decode steps,
speculative verification shapes and short chunks."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from engine.cache import ForwardBatch, Sequence
from engine.cuda_graph import MAX_GRAPH_TOKENS, DecodeGraphs, stage_rows
from engine.engine import Engine, EngineOptions
from helpers.model_factory import make_tiny_llama

PAGE = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-graph")
    make_tiny_llama(path, seed=3)
    return path


def _engine(path: Path, **options) -> Engine:
    opts = dict(device="cpu", dtype="float32", max_seq_len=128, page_size=PAGE, cache_tokens=512)
    opts.update(options)
    return Engine.load(path, EngineOptions(**opts))


def _padded_batch(host: torch.Tensor, T: int, max_context: int) -> ForwardBatch:
    """The ForwardBatch a graph of T tokens per row builds from its host rows."""
    B = host.shape[0]
    return ForwardBatch(
        token_ids=host[:, :T].reshape(-1).clone(),
        positions=host[:, T : 2 * T].reshape(-1).clone(),
        slots=host[:, 2 * T : 3 * T].reshape(-1).clone(),
        cu_seqlens=(torch.arange(B + 1) * T).to(torch.int32),
        context_lens=host[:, 3 * T].to(torch.int32),
        page_table=host[:, 3 * T + 1 :].to(torch.int32),
        logits_indices=torch.arange(B * T),
        max_query_len=T,
        max_context_len=max_context,
    )


def test_stage_rows_layout():
    seq = Sequence(pages=[5, 2], length=11)  # 3 new tokens at positions 8, 9, 10
    host = torch.full((2, 3 * 4 + 1 + 4), -7, dtype=torch.int64)
    scratch = 9 * PAGE  # the cache's slot past its last page
    stage_rows(host, [seq], [[31, 32, 33]], tokens_per_row=4, page_size=PAGE, scratch_slot=scratch)
    row, pad = host[0].tolist(), host[1].tolist()
    assert row[:4] == [31, 32, 33, 0]
    assert row[4:8] == [8, 9, 10, 10]  # padding repeats the last position
    assert row[8:12] == [2 * PAGE + 0, 2 * PAGE + 1, 2 * PAGE + 2, scratch]
    assert row[12] == 8 + 4  # start + T: real tokens keep positions ctx - T + i
    assert row[13:] == [5, 2, 0, 0]  # past its pages: page 0, never read by real tokens
    assert pad[:4] == [0, 0, 0, 0] and pad[4:8] == [0, 1, 2, 3]
    assert pad[8:12] == [scratch] * 4 and pad[12] == 4
    assert pad[13:] == [0, 0, 0, 0]


def test_multi_token_shape_limits(model_dir: Path):
    engine = _engine(model_dir)
    graphs = object.__new__(DecodeGraphs)  # the shape rule needs no captured graph
    graphs.cache, graphs.max_pages = engine.cache, 128 // PAGE
    seqs = [Sequence(length=10) for _ in range(3)]
    assert graphs.multi_token_shape(seqs, [[1], [1, 2, 3], [1, 2]]) == (4, 4)
    assert graphs.multi_token_shape(seqs[:1], [[1] * 5]) == (1, 8)
    assert graphs.multi_token_shape(seqs[:1], [[1] * 9]) is None  # a prefill chunk
    assert graphs.multi_token_shape(seqs, [[1], [], [1]]) is None
    many = [Sequence(length=10) for _ in range(MAX_GRAPH_TOKENS // 4 + 1)]
    assert graphs.multi_token_shape(many, [[1, 2, 3, 4]] * len(many)) is None
    assert graphs.multi_token_shape([Sequence(length=125)], [[1, 2]]) == (1, 2)
    assert graphs.multi_token_shape([Sequence(length=125)], [[1, 2, 3]]) is None  # 125 + 4


def test_padded_rows_give_the_unpadded_logits_and_cache(model_dir: Path):
    """The padding scheme itself, through the model's CPU path: a verify-shaped step of
    rows with 3, 1 and 2 new tokens, padded to T = 4 in a bucket of 4 rows."""
    eager, padded = _engine(model_dir), _engine(model_dir)
    prompts = [[3, 9, 4, 7, 1, 8, 2, 6, 5], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27, 28]]
    states = {}
    for name, engine in (("eager", eager), ("padded", padded)):
        seqs = [Sequence() for _ in prompts]
        for seq, prompt in zip(seqs, prompts, strict=True):
            engine.runner.prefill(seq, prompt)
        states[name] = seqs
    new = [[40, 41, 42], [43], [44, 45]]
    counts = [3, 1, 2]
    want = eager.runner.forward(states["eager"], new, logits_counts=counts)

    seqs = states["padded"]
    for seq, tokens in zip(seqs, new, strict=True):
        seq.reserve(padded.cache, seq.length + len(tokens))
        seq.length += len(tokens)
    T, B, max_pages = 4, 4, 128 // PAGE
    host = torch.zeros((B, 3 * T + 1 + max_pages), dtype=torch.int64)
    stage_rows(host, seqs, new, T, PAGE, padded.cache.scratch_slot)
    before = [plane.clone() for plane in padded.cache.k + padded.cache.v]
    logits = padded.model(_padded_batch(host, T, 128), padded.cache)
    # Padding wrote only the scratch slot: in the pages, just the real new tokens' slots
    # changed (in every layer, K and V).
    real_slots = {
        seq.pages[p // PAGE] * PAGE + p % PAGE
        for seq, tokens in zip(seqs, new, strict=True)
        for p in range(seq.length - len(tokens), seq.length)
    }
    for old, plane in zip(before, padded.cache.k + padded.cache.v, strict=True):
        changed = (old != plane).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert set(changed) == real_slots
    rows = [
        b * T + i
        for b, (n, c) in enumerate(zip(map(len, new), counts, strict=True))
        for i in range(n - c, n)
    ]
    torch.testing.assert_close(logits[rows], want, rtol=1e-5, atol=1e-5)

    # The next plain step sees the same cache in both engines.
    nxt = [[50], [51], [52]]
    torch.testing.assert_close(
        padded.runner.forward(seqs, copy.deepcopy(nxt)), eager.runner.forward(states["eager"], nxt),
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip


@pytest.mark.gpu
def test_multi_token_graphs_equal_eager_forwards(model_dir: Path):
    """Graph replays (decode, verify shapes with padding, short chunks) give the eager
    forward's logits, and leave the same cache behind (the following steps agree)."""
    gpu = dict(device="cuda", dtype="float16")
    graphed, eager = _engine(model_dir, **gpu), _engine(model_dir, **gpu, cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    prompts = [[3, 9, 4, 7, 1, 8, 2, 6, 5], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27, 28]]
    seqs = {e: [Sequence() for _ in prompts] for e in ("g", "e")}
    for key, engine in (("g", graphed), ("e", eager)):
        for seq, prompt in zip(seqs[key], prompts, strict=True):
            engine.runner.prefill(seq, prompt)
    steps = [
        ([[40], [41], [42]], None),
        ([[43, 44, 45, 46, 47], [48], [49, 50]], [5, 1, 2]),  # T = 8, padded
        ([[51, 52], [53, 54], [55, 56]], [2, 2, 2]),
        ([[57, 58, 59], [60], [61]], None),  # a short chunk: last logits only
        ([[62], [63], [64]], None),
    ]
    for new, counts in steps:
        got = graphed.runner.forward(seqs["g"], new, logits_counts=counts)
        want = eager.runner.forward(seqs["e"], new, logits_counts=counts)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert {(4, 1), (4, 2), (4, 4), (4, 8)} <= set(graphed.graphs._graphs)


def test_static_buffer_path_equals_eager_and_capture_all(model_dir: Path):
    """The graph path's static buffers run eagerly (capture=False, on the CPU): every
    shape can be made up front (what tools/soak.py does before measuring memory), and
    verify-shaped and decode steps through them give the eager engine's logits."""
    eager, graphed = _engine(model_dir), _engine(model_dir)
    graphs = graphed.enable_decode_graphs(capture=False)
    graphs.capture_all()
    assert len(graphs.shapes()) == 7 + 6 + 5 + 4  # T = 1, 2, 4, 8 with B * T <= 64
    assert set(graphs._graphs) == set(graphs.shapes())
    assert set(graphs._prompt_graphs) == set(graphs.prompt_buckets()) == {16, 32, 64, 128}
    prompts = [[3, 9, 4, 7, 1, 8, 2, 6, 5, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    seqs = {name: [Sequence() for _ in prompts] for name in ("e", "g")}
    for name, engine in (("e", eager), ("g", graphed)):
        for seq, prompt in zip(seqs[name], prompts, strict=True):
            engine.runner.prefill(seq, prompt)
    for new, counts in (([[40, 41, 42], [43]], [3, 1]), ([[44], [45]], None)):
        got = graphed.runner.forward(seqs["g"], new, logits_counts=counts)
        want = eager.runner.forward(seqs["e"], new, logits_counts=counts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _prompt_graph_run(graphed: Engine, eager: Engine, prompts: list[list[int]], tol: float):
    """Prefill each prompt in both engines (the graphed one through its prompt graphs),
    then one decode step: same last logits, and the same cache behind them."""
    for prompt in prompts:
        seqs = (Sequence(), Sequence())
        got = graphed.runner.prefill(seqs[0], prompt)
        want = eager.runner.prefill(seqs[1], prompt)
        assert got.shape == want.shape == (1, graphed.config.vocab_size)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        nxt = graphed.runner.forward([seqs[0]], [[77]]), eager.runner.forward([seqs[1]], [[77]])
        torch.testing.assert_close(*nxt, rtol=tol, atol=tol)
        for engine, seq in zip((graphed, eager), seqs, strict=True):
            seq.release(engine.cache)


def test_prompt_graphs_give_the_eager_prefill(model_dir: Path):
    """A fresh prompt of 9 to 2048 tokens runs as one padded row (capture=False here: the
    static buffers on the CPU), the last real token's logits only; longer prompts, and a
    bucket that would pass the page table's end, stay eager."""
    eager, graphed = _engine(model_dir), _engine(model_dir)
    graphs = graphed.enable_decode_graphs(capture=False)
    prompts = [[(5 * i + n) % 250 + 2 for i in range(n)] for n in (9, 30, 100, 16)]
    _prompt_graph_run(graphed, eager, prompts, 1e-5)
    assert graphs.prompt_steps == 4 and set(graphs._prompt_graphs) == {16, 32, 128}
    # 120 tokens would pad to 128 = the whole page table (max_seq_len 128): still a graph;
    # a second chunk of a sequence (not fresh) is not.
    assert graphs.prompt_bucket([Sequence()], [[1] * 120]) == 128
    assert graphs.prompt_bucket([Sequence(length=3)], [[1] * 20]) is None
    assert graphs.prompt_bucket([Sequence()], [[1] * 8]) is None  # the multi-token graphs'
    assert graphs.prompt_bucket([Sequence(), Sequence()], [[1] * 20, [1] * 20]) is None
    # Buckets stop at the one that holds a prefill chunk (no longer chunk comes).
    graphs.max_prompt_tokens = 40
    assert graphs.prompt_buckets() == [16, 32, 64]
    assert graphs.prompt_bucket([Sequence()], [[1] * 65]) is None


@pytest.mark.gpu
def test_captured_prompt_graphs_equal_eager_prefill(model_dir: Path):
    """Captured prompt graphs (one shared memory pool) give the eager prefill's logits,
    buckets replayed in any order; a prompt graph's logits outlive the next replay."""
    gpu = dict(device="cuda", dtype="float16", max_seq_len=1100, cache_tokens=4096)
    graphed, eager = _engine(model_dir, **gpu), _engine(model_dir, **gpu, cuda_graphs=False)
    prompts = [[(5 * i + n) % 250 + 2 for i in range(n)] for n in (700, 9, 200, 1000, 190)]
    _prompt_graph_run(graphed, eager, prompts, 2e-2)
    graphs = graphed.graphs
    assert graphs.prompt_steps == 5 and set(graphs._prompt_graphs) == {768, 16, 256, 1024, 192}
    first = graphed.runner.prefill(Sequence(), prompts[0])
    kept = first.clone()
    graphed.runner.prefill(Sequence(), prompts[3])  # another bucket of the same pool
    assert torch.equal(first, kept)
