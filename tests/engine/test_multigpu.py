"""Two GPUs: layer split (manual, auto, with CPU offload) and tensor parallelism over NCCL
give the logits and greedy tokens of one GPU on a random-weight model whose layers are
FP16, EXL2 and GPTQ; a split's decode replays one CUDA graph segment per GPU (LoRA and
speculative steps included). Skipped unless two CUDA devices are visible."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import loader
from engine.config import ModelConfig
from engine.placement import GIB
from engine.placement.footprint import model_footprint
from engine.weights import WeightStore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

GREEDY = {"max_new_tokens": 16, "temperature": 0, "ban_eos_token": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.mixed_model import build_mixed_model

    return build_mixed_model(tmp_path_factory.mktemp("multigpu"))


def _ids() -> list[int]:
    return torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[torch.Tensor, str]:
    m = loader.load(model_dir, "kestrel", device="cuda:0", dtype="float16")
    out = m.logits(_ids()), m.generate(_ids()[:10], GREEDY)
    m.unload()
    return out


# Cache tokens of the runs with several concurrent jobs: the default cache holds one
# sequence (max_seq_len, 256 here), which would run the jobs one after another.
MANY_JOBS_CACHE = 4096


def _split_after_first_layer(model_dir: Path, cache_tokens: int | None = None) -> list[float]:
    """gpu_split (GiB) that holds the embeddings and layer 0 (with its share of a cache of
    `cache_tokens`, default one sequence) on cuda:0, the rest on cuda:1."""
    config = ModelConfig.from_dir(model_dir)
    fp = model_footprint(
        WeightStore(model_dir),
        config,
        dtype=torch.float16,
        cache_tokens=cache_tokens or config.max_position_embeddings,
        page_size=256,
        prefill_chunk=2048,
    )
    first = fp.embed_bytes + fp.layer_bytes[0] + fp.cache_bytes_per_layer
    return [(first + 1024) / GIB, 4.0]


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max()
    assert ((got - expected).abs().max() / scale).item() < 2e-2
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.95


def test_manual_layer_split_matches_one_gpu(model_dir: Path, reference):
    m = loader.load(
        model_dir,
        "kestrel",
        dtype="float16",
        gpu_split=_split_after_first_layer(model_dir),  # graphs per GPU: the default
    )
    try:
        placement = m.info()["placement"]
        assert placement["layers"] == {"cuda:0": "0", "cuda:1": "1-2"}
        assert placement["mode"] == "layer_split"
        assert m.engine.cache.k[0].device == torch.device("cuda:0")
        assert m.engine.cache.k[2].device == torch.device("cuda:1")
        _close(m.logits(_ids()), reference[0])
        assert m.generate(_ids()[:10], GREEDY) == reference[1]
        # Decode replayed one graph per GPU (engine/cuda_graph.py), not eager steps.
        graphs = m.engine.graphs
        assert m.info()["cuda_graphs"] and graphs is not None and graphs.capture
        assert [str(s.device) for s in graphs.segments] == ["cuda:0", "cuda:1"]
        assert graphs._graphs[(1, 1)].replays >= GREEDY["max_new_tokens"] - 1
    finally:
        m.unload()


def _stream(m, prompts: list[list[int]], settings: list[dict]) -> list[list[int]]:
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for chunk in m.stream_many(prompts, settings):
        out[chunk.job_id].extend(chunk.token_ids)
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_layer_split_graphs_match_one_gpu_batched(model_dir: Path, speculative: str | None):
    """Concurrent greedy jobs (a bucket with padding rows) and n-gram speculative steps (the
    multi-token graphs) on a split with one graph segment per GPU give one GPU's tokens and
    the split's eager tokens."""
    ids = _ids()
    prompts = [ids[:10], ids[5:20], ids[10:14], ids[:10] * 3]  # the last repeats: drafts
    settings = [{**GREEDY, "max_new_tokens": 24}] * len(prompts)
    split = _split_after_first_layer(model_dir, MANY_JOBS_CACHE)
    options = dict(dtype="float16", speculative=speculative, cache_tokens=MANY_JOBS_CACHE)
    runs = {}
    for name, extra in (
        ("one_gpu", dict(device="cuda:0")),
        ("split_graphs", dict(gpu_split=split, split_cuda_graphs=True)),
        ("split_eager", dict(gpu_split=split, cuda_graphs=False)),
    ):
        m = loader.load(model_dir, "kestrel", **options, **extra)
        try:
            runs[name] = _stream(m, prompts, settings)
            if name == "split_graphs":
                graphs = m.engine.graphs
                assert len(graphs.segments) == 2
                replayed = {k for k, g in graphs._graphs.items() if g.replays}
                assert (4, 1) in replayed or speculative
                if speculative:
                    assert any(t > 1 for _, t in replayed), replayed
        finally:
            m.unload()
    assert runs["split_graphs"] == runs["one_gpu"]
    assert runs["split_eager"] == runs["one_gpu"]


def test_layer_split_lora_graphs_match_one_gpu(model_dir: Path, tmp_path: Path):
    """LoRA decode steps on a split replay per-GPU segments, each with its own static LoRA
    batch on its GPU, and give one GPU's tokens."""
    from helpers.lora import ALL, hf_model, make_adapter

    base = model_dir.parent / "fp16"  # build_mixed_model's unquantized model
    make_adapter(hf_model(base), tmp_path / "A", 1, r=8, lora_alpha=16, target_modules=ALL)
    make_adapter(hf_model(base), tmp_path / "C", 5, r=4, lora_alpha=8, target_modules=ALL)
    selections = [{"A": 1.0}, {"C": 1.0}, {"A": 0.5, "C": -0.5}, {}, {"C": 2.0}]
    settings = [{**GREEDY, "max_new_tokens": 12, "loras": s} for s in selections]
    runs = {}
    for name, extra in (
        ("one_gpu", dict(device="cuda:0")),
        (
            "split",
            dict(
                gpu_split=_split_after_first_layer(model_dir, MANY_JOBS_CACHE),
                split_cuda_graphs=True,
            ),
        ),
    ):
        m = loader.load(
            model_dir, "kestrel", dtype="float16", cache_tokens=MANY_JOBS_CACHE, **extra
        )
        try:
            m.load_lora(tmp_path / "A", "A")
            m.load_lora(tmp_path / "C", "C")
            runs[name] = _stream(m, [_ids()[:10]] * len(selections), settings)
            graphs = m.engine.graphs
            assert graphs.lora_steps > 0
            if name == "split":
                graph = graphs._lora_graphs[(8, 1)]
                devices = [str(s.lora_batch.body.scales.device) for s in graph.segments]
                assert devices == ["cuda:0", "cuda:1"]
        finally:
            m.unload()
    assert runs["split"] == runs["one_gpu"]


def test_autosplit_and_cpu_offload_run(model_dir: Path, reference):
    m = loader.load(model_dir, "kestrel", dtype="float16", autosplit=True)
    assert m.info()["placement"]["layers"] == {"cuda:0": "0-2"}  # a tiny model fits one GPU
    m.unload()
    split = _split_after_first_layer(model_dir)
    m = loader.load(model_dir, "kestrel", dtype="float16", gpu_split=split[:1], cpu_offload=True)
    try:
        placement = m.info()["placement"]
        assert placement["layers"] == {"cuda:0": "0", "cpu": "1-2"} and placement["head"] == "cpu"
        _close(m.logits(_ids()), reference[0])
    finally:
        m.unload()


def test_tensor_parallel_prompt_rows_take_the_prompt_slices(model_dir: Path, reference):
    """A prompt longer than the decode sites' rows: its quantized row-parallel products are
    summed by the flags kernel over the prompt slices (site_reduce.PROMPT_SLOTS), not NCCL,
    and the logits are one GPU's up to the summation order; then greedy decode through the
    decode sites and their CUDA graphs gives one GPU's text. First of this file's TP tests:
    a process sets up symmetric memory for its first TP launch only (all_reduce.py), so
    the decode sites run here and the later TP tests take NCCL."""
    from engine.tensor_parallel.transform import AllReduceLinear

    ids = torch.randint(3, 384, (200,), generator=torch.Generator().manual_seed(12)).tolist()
    one = loader.load(model_dir, "kestrel", device="cuda:0", dtype="float16")
    try:
        expected = one.logits(ids)
    finally:
        one.unload()
    m = loader.load(model_dir, "kestrel", dtype="float16", tp=2)
    try:
        row_parallel = [x for x in m.engine.model.modules() if isinstance(x, AllReduceLinear)]
        if not any(x.sites is not None for x in row_parallel):
            pytest.skip("no symmetric memory in this process (an earlier TP launch took it)")
        linears = [x for x in row_parallel if x.prompt_sites is not None]
        assert linears, "decode sites but no prompt slices"
        prompt = linears[0].prompt_sites
        epochs = prompt.buffers.epochs
        before = epochs[:, 0].clone()
        deferred: list[int] = []  # prompt sums run inside their norms (fused_sites.py)
        normed = prompt.add_rms_norm

        def counted_norm(site, *args, **kwargs):
            deferred.append(site)
            return normed(site, *args, **kwargs)

        prompt.add_rms_norm = counted_norm
        _close(m.logits(ids), expected)
        assert bool((epochs[:, 0] > before).all())  # both slices took calls
        assert sorted(set(deferred)) == [0, 1], deferred
        # Decode rows take the decode sites (one instance for every linear and norm): count
        # the calls that launch their kernels (a CUDA graph's replays relaunch its capture).
        sites = linears[0].sites
        calls: list[str] = []
        for name in ("sum", "add_rms_norm"):
            method = getattr(sites, name)

            def counted(*args, _method=method, _name=name, **kwargs):
                calls.append(_name)
                return _method(*args, **kwargs)

            setattr(sites, name, counted)
        assert m.generate(_ids()[:10], GREEDY) == reference[1]
        assert "add_rms_norm" in calls  # the fused sum + residual add + norm ran
    finally:
        m.unload()


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_tensor_parallel_over_nccl_matches_one_gpu(model_dir: Path, reference, cuda_graphs: bool):
    m = loader.load(model_dir, "kestrel", dtype="float16", tp=2, cuda_graphs=cuda_graphs)
    try:
        info = m.info()
        assert info["placement"]["ranks"] == ["cuda:0", "cuda:1"]
        assert info["cuda_graphs"] == cuda_graphs
        _close(m.logits(_ids()), reference[0])
        assert m.generate(_ids()[:10], GREEDY) == reference[1]
    finally:
        m.unload()


def test_tensor_parallel_with_a_quantized_cache_matches_one_gpu(model_dir: Path, reference):
    """Each rank keeps its KV heads' q8 rows: one GPU's q8 logits up to the cache's own
    quantization noise (the ranks sum in another order, and a value near a rounding boundary
    of the cache may round the other way; see tests/engine/test_tensor_parallel.py)."""
    one = loader.load(model_dir, "kestrel", device="cuda:0", dtype="float16", cache_type="q8")
    try:
        expected = one.logits(_ids())
    finally:
        one.unload()
    noise = float((expected - reference[0]).abs().max())  # q8 against the fp16 cache
    m = loader.load(model_dir, "kestrel", dtype="float16", tp=2, cache_type="q8")
    try:
        assert m.engine.cache.cache_type == "q8"
        logits = m.logits(_ids())
        _close(logits, expected)
        assert float((logits - expected).abs().max()) <= max(noise, 1e-3)
    finally:
        m.unload()
