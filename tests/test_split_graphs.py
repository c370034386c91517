"""Decode graphs of a layer-split model (engine/cuda_graph.py): one graph segment per device,
replayed in order with the hidden states copied between segments.

On the CPU, `split_at` cuts a one-device model into segments and `capture=False` runs each
segment's static buffers eagerly: the segmented path (each segment's own batch and LoRA
batch, the static input buffers, the copies between them) must give the eager engine's
logits and greedy tokens, for decode steps, multi-token steps and LoRA steps. On one GPU
the same segments are captured and replayed; tests/test_multigpu.py runs a real split over
two GPUs against one GPU."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_lora import ALL, GREEDY, IDS, _hf, _make_adapter

import loader
from engine.cache import Sequence
from engine.cuda_graph import DecodeGraphs, Segment, plan_segments
from engine.engine import Engine, EngineOptions

from model_factory import make_tiny_llama

PAGE = 8
LAYERS = 3
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-split")
    make_tiny_llama(path, seed=4, num_hidden_layers=LAYERS)
    return path


def _engine(path: Path, device: str = "cpu", **options) -> Engine:
    opts = dict(
        device=device,
        dtype="float32" if device == "cpu" else "float16",
        max_seq_len=128,
        page_size=PAGE,
        cache_tokens=512,
        cuda_graphs=False,
    )
    opts.update(options)
    return Engine.load(path, EngineOptions(**opts))


def _fake_model(embed: str, layers: list[str], head: str) -> SimpleNamespace:
    """What plan_segments reads of a model: the devices of its parts (no GPU needed)."""
    return SimpleNamespace(
        embed_device=torch.device(embed),
        layer_devices=[torch.device(d) for d in layers],
        lm_head_device=torch.device(head),
    )


def test_plan_segments_cut_at_device_changes():
    cpu, c0, c1, c2 = (torch.device(d) for d in ("cpu", "cuda:0", "cuda:1", "cuda:2"))
    one = _fake_model("cpu", ["cpu"] * 4, "cpu")
    assert plan_segments(one) == [Segment(cpu, 0, 4, embed=True, head=True)]
    split = _fake_model("cuda:0", ["cuda:0", "cuda:0", "cuda:1", "cuda:1"], "cuda:1")
    assert plan_segments(split) == [
        Segment(c0, 0, 2, embed=True, head=False),
        Segment(c1, 2, 4, embed=False, head=True),
    ]
    # Embeddings alone on the first GPU, the head alone on the last: segments without layers.
    apart = _fake_model("cuda:0", ["cuda:1"] * 4, "cuda:2")
    assert plan_segments(apart) == [
        Segment(c0, 0, 0, embed=True, head=False),
        Segment(c1, 0, 4, embed=False, head=False),
        Segment(c2, 4, 4, embed=False, head=True),
    ]
    # split_at cuts before the layers it names, on one device too (0: after the
    # embeddings, 4 = the layer count: before the head).
    assert plan_segments(one, split_at=(0, 2, 4)) == [
        Segment(cpu, 0, 0, embed=True, head=False),
        Segment(cpu, 0, 2, embed=False, head=False),
        Segment(cpu, 2, 4, embed=False, head=False),
        Segment(cpu, 4, 4, embed=False, head=True),
    ]
    assert plan_segments(split, split_at=(2,)) == plan_segments(split)  # already a cut
    with pytest.raises(ValueError, match="split_at"):
        plan_segments(one, split_at=(5,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split_at", [(1,), (0, 2, LAYERS)])
def test_segmented_graphs_equal_eager_forwards(
    model_dir: Path, device: str, split_at: tuple[int, ...]
):
    """Decode steps (3 rows in a bucket of 4), verify-shaped steps with padding and short
    chunks through a segmented graph give the eager forward's logits, and leave the same
    cache behind (the following steps agree). CPU: static buffers run eagerly; GPU: each
    segment captured and replayed."""
    capture = device == "cuda"
    eager, graphed = _engine(model_dir, device), _engine(model_dir, device)
    graphs = graphed.enable_decode_graphs(capture=capture, split_at=split_at)
    assert len(graphs.segments) == len(split_at) + 1
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
        ([[65], [66], [67]], None),
    ]
    tol = 1e-5 if device == "cpu" else 2e-2
    for new, counts in steps:
        got = graphed.runner.forward(seqs["g"], new, logits_counts=counts)
        want = eager.runner.forward(seqs["e"], new, logits_counts=counts)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    decode = graphs._graphs[(4, 1)]
    assert decode.replays == 3 and decode.captured == capture
    # Each segment after the first reads its own static input, which the replays refill.
    inputs = [s.hidden for s in decode.segments]
    assert inputs[0] is None and all(h is not None for h in inputs[1:])
    assert len({h.data_ptr() for h in inputs[1:]}) == len(inputs) - 1
    if capture:
        assert all(s.graph is not None for s in decode.segments)


def test_segmented_generation_equals_eager(model_dir: Path):
    """Greedy jobs through the scheduler (batched decode, padding rows) give the same tokens
    through a two-segment static path as eagerly."""
    prompts = [IDS[:9], IDS[3:7], IDS[:12]]
    settings = {**GREEDY, "max_new_tokens": 12}

    def run(split: bool) -> list[list[int]]:
        m = loader.load(model_dir, "kestrel", device="cpu", dtype="float32", max_seq_len=128,
                        page_size=PAGE, cache_tokens=1024)  # fmt: skip
        if split:
            m.engine.enable_decode_graphs(capture=False, split_at=(2,))
        out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        for chunk in m.stream_many(prompts, settings):
            out[chunk.job_id].extend(chunk.token_ids)
        if split:
            assert sum(g.replays for g in m.engine.graphs._graphs.values()) > 0
        m.unload()
        return [out[i] for i in range(len(prompts))]

    assert run(split=True) == run(split=False)


def test_capture_needs_cuda_segments(model_dir: Path):
    engine = _engine(model_dir)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(engine.model, engine.cache, 128, capture=True)


# -- LoRA through the segments -------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("split-adapters")
    base = _hf(model_dir)
    _make_adapter(base, root / "A", 1, r=8, lora_alpha=16, target_modules=ALL)
    _make_adapter(_hf(model_dir), root / "C", 5, r=4, lora_alpha=8, target_modules=ALL)
    return {name: root / name for name in "AC"}


@pytest.mark.parametrize("device", DEVICES)
def test_lora_steps_through_segments(model_dir: Path, adapters: dict[str, Path], device: str):
    """LoRA decode steps replay the segmented graphs, every segment with its own static
    LoRA batch on its device holding the step's scales, and give the eager tokens."""
    selections = [{"A": 1.0}, {"C": 1.0}, {"A": 0.5, "C": -0.5}, {}, {"C": 2.0}]

    def run(split: bool) -> list[list[int]]:
        # The reference: eager on the CPU; one captured segment on a GPU (the same kernels,
        # so the tokens must agree exactly).
        m = loader.load(
            model_dir,
            "kestrel",
            device=device,
            dtype="float32" if device == "cpu" else "float16",
            max_seq_len=128,
            page_size=PAGE,
            cache_tokens=2048,
            cuda_graphs=False,
            lora_cuda_graphs=True,
        )
        if split or device == "cuda":
            split_at = (1, LAYERS) if split else ()
            m.engine.enable_decode_graphs(capture=device == "cuda", split_at=split_at)
        m.load_lora(adapters["A"], "A")
        m.load_lora(adapters["C"], "C")
        out: dict[int, list[int]] = {i: [] for i in range(len(selections))}
        settings = [{**GREEDY, "max_new_tokens": 10, "loras": s} for s in selections]
        for chunk in m.stream_many([IDS] * len(selections), settings):
            out[chunk.job_id].extend(chunk.token_ids)
        if split:
            graphs = m.engine.graphs
            assert graphs.lora_steps > 0
            graph = graphs._lora_graphs[(8, 1)]
            batches = [s.lora_batch for s in graph.segments]
            assert len({id(b) for b in batches}) == 3
            assert all(b.body.scales.device.type == device for b in batches)
            for b in batches[1:]:
                torch.testing.assert_close(b.body.scales, batches[0].body.scales)
        m.unload()
        return [out[i] for i in range(len(selections))]

    assert run(split=True) == run(split=False)
