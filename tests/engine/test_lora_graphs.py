"""Decode steps with LoRA adapters through the decode graphs (engine/cuda_graph.py).

Three ways to run a LoRA decode step, which must give the same greedy tokens:
- eager: `ModelRunner.forward` builds a fresh batch and LoRA segments every step;
- static: the decode graphs' static buffers (bucket-padded batch, static LoRA scales and
  segment starts) staged as for a replay, the forward run on them without capture
  (`enable_decode_graphs(capture=False)`), which runs on the CPU;
- graph: the same buffers captured and replayed as CUDA graphs (GPU only).
static == eager checks what the graph path feeds the model; graph == static checks the
capture (a buffer freed after capture, a host-side value baked in). The scenarios cover a
batch mixing adapters (padding rows included), scale changes between requests, hot load
and unload mid-run (slots renumbered, stacks re-allocated), and an adapter replaced by one
of another rank under the same name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import loader
from engine.cache import Sequence
from engine.engine import Engine
from engine.lora import LoraError, LoraLinear
from helpers.lora import ALL, GREEDY, IDS, hf_model, make_adapter
from helpers.model_factory import make_tiny_llama

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    make_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def adapters(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A: rank 8 everywhere (rslora); B: rank 4 on q/v/down with its own lm_head
    (modules_to_save, so steps selecting it run eagerly); C: rank 16 everywhere."""
    root = tmp_path_factory.mktemp("adapters")
    make_adapter(
        hf_model(tiny), root / "A", 1, r=8, lora_alpha=16, target_modules=ALL, use_rslora=True
    )
    make_adapter(
        hf_model(tiny),
        root / "B",
        2,
        r=4,
        lora_alpha=3,
        target_modules=["q_proj", "v_proj", "down_proj"],
        modules_to_save=["lm_head"],
    )
    make_adapter(hf_model(tiny), root / "C", 5, r=16, lora_alpha=16, target_modules=ALL)
    return {name: root / name for name in "ABC"}


def _load(tiny: Path, device: str, mode: str):
    """A model whose LoRA decode steps run `mode`: eager, static or graph."""
    m = loader.load(
        tiny,
        "kestrel",
        device=device,
        dtype="float16" if device == "cuda" else "float32",
        max_seq_len=128,
        cache_tokens=2048,
        page_size=8,
        prefill_chunk=16,
        cuda_graphs=mode == "graph",
        lora_cuda_graphs=True,
    )
    if mode == "static":
        m.engine.enable_decode_graphs(capture=False)
    if mode == "graph":
        assert m.engine.graphs is not None and m.engine.graphs.capture
    return m


def _tokens(m, prompt: list[int], settings: dict) -> list[int]:
    return [t for c in m.stream(prompt, settings) for t in c.token_ids]


def _many(m, settings: list[dict], on_chunk: Callable[[int], None] | None = None):
    out: dict[int, list[int]] = {i: [] for i in range(len(settings))}
    for i, chunk in enumerate(m.stream_many([IDS] * len(settings), settings)):
        out[chunk.job_id].extend(chunk.token_ids)
        if on_chunk is not None:
            on_chunk(i)
    return [out[i] for i in range(len(settings))]


Scenario = Callable[[object, dict[str, Path]], list[list[int]]]


def _compare(tiny: Path, adapters: dict[str, Path], device: str, scenario: Scenario):
    """Run `scenario` on an eager, a static and (on a GPU) a graph engine; all must agree.
    Returns the eager run's tokens."""
    modes = ["eager", "static"] + (["graph"] if device == "cuda" else [])
    runs = {}
    for mode in modes:
        m = _load(tiny, device, mode)
        runs[mode] = scenario(m, adapters)
        if mode != "eager":
            # The LoRA steps took the graph path: the comparison tests something.
            assert m.engine.graphs.lora_steps > 0, mode
        m.unload()
    if "graph" in runs:
        assert runs["graph"] == runs["static"], (
            "graph replay differs from the same static inputs run eagerly: the capture is wrong"
        )
    assert runs["static"] == runs["eager"], "the graph path's inputs differ from the eager path's"
    return runs["eager"]


def _mixed(m, paths: dict[str, Path]) -> list[list[int]]:
    m.load_lora(paths["A"])
    m.load_lora(paths["C"])
    selections = [{"A": 1.0}, {"C": 1.0}, {"A": 0.5, "C": 0.5}, {}, {"C": -0.7}]
    junk: list[torch.Tensor] = []

    def flood(i: int) -> None:
        # Small allocations after the capture take any freed block a graph still reads.
        if i == 8 and m.engine.logits_device.type == "cuda":
            junk.extend(torch.full((64,), 3, dtype=torch.int32, device="cuda") for _ in range(4096))

    # 5 jobs: bucket 8, so 3 padding rows
    return _many(m, [{**GREEDY, "max_new_tokens": 16, "loras": s} for s in selections], flood)


def _scales(m, paths: dict[str, Path]) -> list[list[int]]:
    m.load_lora(paths["A"])
    graphs = m.engine.graphs
    runs, seen = [], []
    for scale in (1.0, 0.25, -1.0, 2.0):
        runs.append(_tokens(m, IDS, {**GREEDY, "loras": {"A": scale}}))
        if graphs is not None:
            seen.append(graphs._lora_graphs.get((1, 1)))
    runs += _many(m, [{**GREEDY, "loras": {"A": 0.5}}, {**GREEDY, "loras": {"A": 1.5}}])
    if graphs is not None:
        # A scale is a value in the static buffer: no capture per request.
        assert seen[0] is not None and all(g is seen[0] for g in seen)
    return runs


def _hot_load(m, paths: dict[str, Path]) -> list[list[int]]:
    m.load_lora(paths["B"], name="X")  # slot 0 until it is unloaded mid-run
    m.load_lora(paths["A"])
    graphs = m.engine.graphs
    before: list[object] = []

    def hot(i: int) -> None:
        if i == 6:
            before.append(graphs._lora_graphs.get((4, 1)) if graphs is not None else None)
            assert m.unload_lora("X") is True  # A moves to slot 0, the stacks are rebuilt
            m.load_lora(paths["C"])
        if i == 12:
            m.load_lora(paths["B"])  # lm_head becomes a replacement holder, unselected

    settings = [{"A": 1.0}, {"A": 0.5}, {}]  # bucket 4: one padding row
    runs = _many(m, [{**GREEDY, "max_new_tokens": 16, "loras": s} for s in settings], hot)
    if graphs is not None:
        after = graphs._lora_graphs.get((4, 1))
        assert before[0] is not None and after is not None and after is not before[0]
    # Requests for the adapters loaded mid-run, one of them beside B's replacement (eager).
    runs.append(_tokens(m, IDS, {**GREEDY, "loras": {"C": 1.0}}))
    runs += _many(m, [{**GREEDY, "loras": {"C": 1.0, "A": 0.5}}, {**GREEDY, "loras": {"B": 1}}])
    return runs


def _other_rank(m, paths: dict[str, Path]) -> list[list[int]]:
    m.load_lora(paths["A"], name="L")  # rank 8
    first = _tokens(m, IDS, {**GREEDY, "loras": {"L": 1.0}})
    assert m.unload_lora("L") is True
    m.load_lora(paths["C"], name="L")  # rank 16 under the same name and slot
    second = _tokens(m, IDS, {**GREEDY, "loras": {"L": 1.0}})
    assert m.unload_lora("L") is True
    m.load_lora(paths["A"], name="Z")
    third = _tokens(m, IDS, {**GREEDY, "loras": {"Z": 1.0}})
    assert second != first and third == first
    return [first, second, third]


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_adapters_in_one_batch(tiny: Path, adapters: dict[str, Path], device: str):
    runs = _compare(tiny, adapters, device, _mixed)
    assert len({tuple(r) for r in runs}) == len(runs)  # every selection changes the tokens


@pytest.mark.parametrize("device", DEVICES)
def test_scale_changes_between_requests(tiny: Path, adapters: dict[str, Path], device: str):
    runs = _compare(tiny, adapters, device, _scales)
    assert len({tuple(r) for r in runs}) == len(runs)


@pytest.mark.parametrize("device", DEVICES)
def test_hot_load_and_unload_mid_run(tiny: Path, adapters: dict[str, Path], device: str):
    _compare(tiny, adapters, device, _hot_load)


@pytest.mark.parametrize("device", DEVICES)
def test_unload_then_load_other_rank(tiny: Path, adapters: dict[str, Path], device: str):
    _compare(tiny, adapters, device, _other_rank)


# -- what a LoRA graph reads (CPU) -------------------------------------------------------------


def _static_engine(tiny: Path) -> Engine:
    return _load(tiny, "cpu", "static").engine


def _prefilled(engine: Engine, count: int) -> list[Sequence]:
    sequences = [Sequence() for _ in range(count)]
    with engine.lock:
        for i, seq in enumerate(sequences):
            engine.runner.prefill(seq, IDS[: 8 + i])
    return sequences


def test_graph_reads_its_own_static_buffers_refreshed_each_step(
    tiny: Path, adapters: dict[str, Path]
):
    """Every LoRA decode step reads the LoRA batch that the graph object owns (so its
    tensors live as long as the graph), at unchanged addresses, with this step's scales in
    the live rows and 0 in the padding row."""
    engine = _static_engine(tiny)
    engine.loras.load(adapters["A"], "A")
    engine.loras.load(adapters["C"], "C")
    module = next(m for m in engine.model.modules() if isinstance(m, LoraLinear))
    seen: list[tuple] = []

    def record(mod: LoraLinear, args: tuple) -> None:
        batch = args[1] if len(args) > 1 else None  # linear(x, lora): the step's LoraBatch
        if batch is not None:
            starts, scales = batch.body.starts, batch.body.scales
            seen.append((batch, starts.data_ptr(), scales.data_ptr(), scales.clone()))

    module.register_forward_pre_hook(record)
    sequences = _prefilled(engine, 4)
    steps = [  # bucket 4; the last steps leave a padding row where a live row was
        [{"A": 1.0}, {"C": 0.5}, {}, {"A": -2.0, "C": 1.0}],
        [{"A": 0.25, "C": 2.0}, {}, {"C": -1.0}],
        [{}, {"A": 3.0}, {"A": 1.0}],
    ]
    seen.clear()
    with engine.lock:
        for selections in steps:
            n = len(selections)
            engine.runner.forward(sequences[:n], [[7 + i] for i in range(n)], loras=selections)
    graph = engine.graphs._lora_graphs[(4, 1)]
    assert engine.graphs.lora_steps == len(steps) and graph.replays == len(steps)
    assert len(seen) == len(steps)
    for (batch, starts_ptr, scales_ptr, scales), selections in zip(seen, steps, strict=True):
        assert batch is graph.lora_batch and batch.head is batch.body
        assert starts_ptr == graph.lora_batch.body.starts.data_ptr()
        assert scales_ptr == graph.lora_scales.data_ptr()
        want = torch.zeros(4, 2)
        for row, selection in enumerate(selections):
            for name, scale in selection.items():
                want[row, ["A", "C"].index(name)] = scale
        torch.testing.assert_close(scales, want, rtol=0, atol=0)
    assert graph.lora_batch.body.starts.tolist() == list(range(5))


def test_lora_graphs_recaptured_when_stacks_change(tiny: Path, adapters: dict[str, Path]):
    """A LoRA graph lives exactly as long as the stacks it read: a scale change keeps it, a
    load or unload (stacks re-allocated, slots renumbered) replaces it, and a stale graph
    refuses scales of another slot count."""
    engine = _static_engine(tiny)
    graphs, loras = engine.graphs, engine.loras

    def stacks() -> tuple:
        return tuple(
            (name, t.data_ptr())
            for name, m in engine.model.named_modules()
            if isinstance(m, LoraLinear)
            for t in (m.lora_a, m.lora_b, m.slot_map)
            if t is not None
        )

    loras.load(adapters["A"], "A")
    first, layout = graphs.graph(2, loras), stacks()
    assert graphs.graph(2, loras) is first and first.lora_scales.shape == (2, 1)
    loras.set_default({"A": 0.5})
    assert graphs.graph(2, loras) is first
    with pytest.raises(LoraError):
        loras.load(adapters["A"].parent / "missing", "M")
    assert stacks() == layout and graphs.graph(2, loras) is first

    loras.load(adapters["C"], "C")
    assert not graphs._lora_graphs  # dropped at once, not only at the next step
    assert stacks() != layout
    second = graphs.graph(2, loras)
    assert second is not first and second.lora_scales.shape == (2, 2)
    with pytest.raises(ValueError, match="captured for 1 adapter slots.*stale graph"):
        first.stage(_prefilled(engine, 1), [5], torch.ones(1, 2))

    layout = stacks()
    loras.unload("A")  # C moves to slot 0
    assert stacks() != layout
    third = graphs.graph(2, loras)
    assert third is not second and third.lora_scales.shape == (2, 1)
    # The non-LoRA graphs are not LoRA graphs and never change with the adapters.
    plain = graphs.graph(2)
    assert plain.lora_batch is None and plain is not third
    with pytest.raises(ValueError, match="captured without LoRA"):
        plain.stage(_prefilled(engine, 1), [5], torch.ones(1, 1))


def test_replacement_steps_run_eagerly(tiny: Path, adapters: dict[str, Path]):
    """A step where a row uses a modules_to_save replacement (B's lm_head) runs eagerly
    (its rows are chosen on the host); other LoRA steps take the graphs, unless
    `lora_graphs` is off."""
    engine = _static_engine(tiny)
    engine.loras.load(adapters["A"], "A")
    engine.loras.load(adapters["B"], "B")
    sequences = _prefilled(engine, 2)
    with engine.lock:
        engine.runner.forward(sequences, [[7], [8]], loras=[{"A": 1.0}, {}])
        assert engine.graphs.lora_steps == 1
        engine.runner.forward(sequences, [[7], [8]], loras=[{"A": 1.0}, {"B": 1.0}])
        assert engine.graphs.lora_steps == 1
        engine.lora_graphs = False
        engine.runner.forward(sequences, [[7], [8]], loras=[{"A": 1.0}, {}])
        assert engine.graphs.lora_steps == 1


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_quantized_decode_lora_in_graph_equals_reference(rows: int):
    """A decode step of LoraLinear on a quantized base (GEMV sizes: the expand stores into a
    partial slot of the GEMV, summed after the join; 4 rows: the dot path and a separate
    expand), eagerly and replayed from a
    CUDA graph whose LoRA kernels ran on a side stream: both equal the dequantized base plus
    the reference delta, for inputs and scales set after capture. The base has padded
    columns (out_features < n)."""
    from engine.lora.batch import LoraBatch, LoraSegments
    from engine.lora.layers import LoraLinear
    from engine.quantized_linear import QuantizedLinear
    from helpers.quant_weights import make_weight
    from kernels.lora_matmul import lora_matmul_reference
    from kernels.quant_matmul import quant_matmul_reference

    torch.manual_seed(0)
    qw = make_weight(512, 384, [4, 3], device="cuda", seed=5)
    layer = LoraLinear(QuantizedLinear(qw, 352, "exl2"), head=False)
    layer.lora_a = (torch.randn(2, 16, 512, device="cuda") / 512**0.5).half()
    layer.lora_b = (torch.randn(2, 352, 16, device="cuda") * 0.05).half()
    layer.slot_map = torch.tensor([1, -1, 0], dtype=torch.int32, device="cuda")
    scales = torch.zeros(rows, 3)
    seg = LoraSegments(
        starts=torch.arange(rows + 1, dtype=torch.int32, device="cuda"),
        scales=scales.cuda(),
        max_len=1,
        host_starts=list(range(rows + 1)),
        host_scales=scales,
    )
    x = torch.zeros(rows, 512, dtype=torch.float16, device="cuda")
    lora = LoraBatch(body=seg, head=seg)

    def want() -> torch.Tensor:
        base = quant_matmul_reference(x.float(), qw)[:, :352]
        return lora_matmul_reference(
            base, x.float(), layer.lora_a.float(), layer.lora_b.float(), layer.slot_map,
            seg.starts, seg.scales, max_seg_len=1,
        )  # fmt: skip

    def fill(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(rows, 512, generator=gen))
        s = torch.randn(rows, 3, generator=gen)
        s[0, 1] = 0.0
        if rows > 1:
            s[1] = 0.0  # a row without adapters
        seg.scales.copy_(s)

    fill(1)
    eager = layer(x, lora)
    torch.testing.assert_close(eager.float(), want(), rtol=3e-3, atol=3e-3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x, lora)  # warm-up outside the capture (the GEMV caches its tiling check)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, lora)
    for seed in (2, 3, 4):
        fill(seed)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), want(), rtol=3e-3, atol=3e-3)
