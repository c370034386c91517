"""LoRA adapters (engine/lora) against peft on tiny random models, on the CPU.

peft is the reference: adapters are made by peft (random non-zero A and B), saved with
save_pretrained, and Kestrel's logits must equal those of peft's PeftModel. The batching
tests run through the scheduler: one batch mixing adapters must give each request the
tokens it gets alone.
"""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

import loader
from engine.lora import LoraError, LoraLinear
from engine.modules import Embedding
from engine.sampling_settings import SamplingSettings, SamplingSettingsError

from model_factory import make_tiny_llama, make_tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = [5, 17, 99, 203, 11, 42, 300, 7, 64, 128, 250, 31, 77, 190, 3, 360]
GREEDY = {"temperature": 0, "ban_eos_token": True, "max_new_tokens": 8}


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < tol, f"relative error {err}"


def _make_adapter(base: torch.nn.Module, path: Path, seed: int, **config) -> torch.nn.Module:
    """Save a peft adapter with random non-zero A and B (and random modules_to_save weights:
    peft copies the base's, which would test nothing); returns the PeftModel (eval)."""
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    make_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def adapters(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A: rank 8 on every linear, rslora; B: rank 4 on q/v/down with alpha != r and its
    own lm_head (modules_to_save)."""
    root = tmp_path_factory.mktemp("adapters")
    _make_adapter(_hf(tiny), root / "A", 1, r=8, lora_alpha=16, target_modules=ALL, use_rslora=True)
    _make_adapter(
        _hf(tiny),
        root / "B",
        2,
        r=4,
        lora_alpha=3,
        target_modules=["q_proj", "v_proj", "down_proj"],
        modules_to_save=["lm_head"],
    )
    return {"A": root / "A", "B": root / "B"}


def _hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _load(path: Path, **options):
    return loader.load(path, "kestrel", device="cpu", dtype="float32", **options)


def _peft(tiny: Path, adapters: dict[str, Path], scales: dict[str, float]) -> PeftModel:
    """The HF model with peft's adapters `scales` active at those scales."""
    names = list(scales)
    model = PeftModel.from_pretrained(_hf(tiny), adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.base_model.set_adapter(names)
    for module in model.modules():
        if hasattr(module, "set_scale"):
            for name, scale in scales.items():
                module.set_scale(name, scale)
    return model.eval()


def test_logits_match_peft(tiny: Path, adapters: dict[str, Path]):
    m = _load(tiny)
    base = m.logits(IDS)
    assert m.load_lora(adapters["A"]) == "A"
    assert m.load_lora(adapters["B"], name="B") == "B"
    assert set(m.info()["loras"]) == {"A", "B"}
    # Loaded but not selected: the base model.
    torch.testing.assert_close(m.logits(IDS), base)
    ids = torch.tensor([IDS])
    for scales in ({"A": 1.0}, {"B": 1.0}):
        m.set_loras(scales)
        want = _peft(tiny, adapters, scales)(ids).logits[0].detach()
        assert (want - base).abs().max() > 0.1  # the adapter changes something
        _close(m.logits(IDS), want)
    assert m.loras()["B"]["scale"] == 1.0
    m.set_loras({})
    _close(m.logits(IDS), base)


def test_two_adapters_with_scales_match_peft(tiny: Path, adapters: dict[str, Path], tmp_path):
    # A + B at their own scales; B without its lm_head, so peft's weighted sum applies.
    b2 = tmp_path / "B2"
    b2.mkdir()
    cfg = json.loads((adapters["B"] / "adapter_config.json").read_text())
    cfg["modules_to_save"] = None
    (b2 / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(adapters["B"] / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "lora_" in k}, b2 / "adapter_model.safetensors")
    m = _load(tiny)
    m.load_lora(adapters["A"])
    m.load_lora(b2)
    scales = {"A": 0.5, "B2": 0.75}
    want = _peft(tiny, {"A": adapters["A"], "B2": b2}, scales)(torch.tensor([IDS])).logits[0]
    _close(m.engine.logits(IDS, loras=scales), want.detach())


def test_embed_tokens_replacement_matches_peft(tiny: Path, tmp_path: Path):
    ref = _make_adapter(
        _hf(tiny),
        tmp_path / "E",
        7,
        r=4,
        lora_alpha=4,
        target_modules=["k_proj"],
        modules_to_save=["embed_tokens"],
    )
    m = _load(tiny)
    m.load_lora(tmp_path / "E")
    assert m.loras()["E"]["modules_to_save"] == ["model.embed_tokens"]
    _close(m.engine.logits(IDS, loras={"E": 1}), ref(torch.tensor([IDS])).logits[0].detach())
    assert m.unload_lora("E")
    assert type(m.engine.model.model.embed_tokens) is Embedding  # unwrapped


def test_lora_on_lm_head_matches_peft(tiny: Path, tmp_path: Path):
    """A LoRA on lm_head sees only the logits rows; peft saves the head's base weight beside
    it (lm_head.base_layer.weight), which equals the model's and is dropped."""
    ref = _make_adapter(
        _hf(tiny), tmp_path / "H", 8, r=4, lora_alpha=8, target_modules=["lm_head", "v_proj"]
    )
    saved = load_file(tmp_path / "H" / "adapter_model.safetensors")
    assert "base_model.model.lm_head.base_layer.weight" in saved
    m = _load(tiny, max_seq_len=128, cache_tokens=512, page_size=8)
    m.load_lora(tmp_path / "H")
    assert m.loras()["H"]["modules_to_save"] == []  # the copy was the model's own head
    want = ref(torch.tensor([IDS])).logits[0].detach()
    _close(m.engine.logits(IDS, loras={"H": 1}), want)
    # Greedy decode with the head's LoRA beside a request without it, in one batch.
    settings = [{**GREEDY, "loras": {"H": 1.0}}, {**GREEDY, "loras": {}}]
    single = [[t for c in m.stream(IDS, s) for t in c.token_ids] for s in settings]
    batched: dict[int, list[int]] = {0: [], 1: []}
    for chunk in m.stream_many([IDS, IDS], settings):
        batched[chunk.job_id].extend(chunk.token_ids)
    assert [batched[0], batched[1]] == single and single[0] != single[1]
    assert single[0][0] == int(want[-1].argmax())
    # A head trained too (its saved base weight differs): it replaces the model's head and
    # the LoRA adds to it, as peft loads it.
    saved["base_model.model.lm_head.base_layer.weight"] += 0.05 * torch.randn(384, 64)
    (tmp_path / "H2").mkdir()
    save_file(saved, tmp_path / "H2" / "adapter_model.safetensors")
    config = (tmp_path / "H" / "adapter_config.json").read_text()
    (tmp_path / "H2" / "adapter_config.json").write_text(config)
    m.load_lora(tmp_path / "H2")
    assert m.loras()["H2"]["modules_to_save"] == ["lm_head"]
    want = PeftModel.from_pretrained(_hf(tiny), tmp_path / "H2").eval()(torch.tensor([IDS]))
    _close(m.engine.logits(IDS, loras={"H2": 1}), want.logits[0].detach())


def test_pickled_adapter_loads_safely_or_is_refused(tiny: Path, tmp_path: Path):
    ref = _make_adapter(_hf(tiny), tmp_path / "ok", 3, r=4, lora_alpha=8, target_modules=["o_proj"])
    safetensors = load_file(tmp_path / "ok" / "adapter_model.safetensors")
    (tmp_path / "ok" / "adapter_model.safetensors").unlink()
    torch.save(safetensors, tmp_path / "ok" / "adapter_model.bin")
    m = _load(tiny)
    m.load_lora(tmp_path / "ok")
    m.set_loras({"ok": 1})
    _close(m.logits(IDS), ref(torch.tensor([IDS])).logits[0].detach())

    class Exploit:  # unpickling this would run code
        def __reduce__(self):
            return (print, ("pwned",))

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((tmp_path / "ok" / "adapter_config.json").read_text())
    torch.save({"x": Exploit()}, bad / "adapter_model.bin")
    with pytest.raises(LoraError, match=r"adapter_model\.bin: refused.*weights_only"):
        m.load_lora(bad)


@pytest.mark.parametrize("fmt", ["exl2", "gptq"])
def test_quantized_base_equals_dequantized_base_plus_peft(
    tiny: Path, adapters: dict[str, Path], tmp_path: Path, fmt: str
):
    """On an EXL2 / GPTQ base (every linear and the head quantized by the project's
    writers), Kestrel with an adapter equals peft on the dequantized model: the delta is
    applied unmerged on top of the quantized matmul, and B's lm_head replaces a quantized
    head."""
    from test_quantized_model import _exl2, _gptq, _quantize_model

    quantize = _exl2 if fmt == "exl2" else _gptq(4, 32, True, True, False)
    ref = _quantize_model(tiny, tmp_path / fmt, quantize)
    if fmt == "gptq":
        cfg = json.loads((tmp_path / fmt / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
        (tmp_path / fmt / "config.json").write_text(json.dumps(cfg))
    m = _load(tmp_path / fmt)
    assert m.engine.model.model.layers[0].mlp.down_proj.format == fmt
    m.load_lora(adapters["A"])
    m.load_lora(adapters["B"])
    model = PeftModel.from_pretrained(ref, adapters["A"], adapter_name="A")
    model.load_adapter(adapters["B"], adapter_name="B")
    for name in ("A", "B"):
        model.set_adapter(name)
        want = model.eval()(torch.tensor([IDS])).logits[0].detach()
        _close(m.engine.logits(IDS, loras={name: 1.0}), want)


def test_fused_phi3_adapters(tmp_path: Path):
    """Phi-3 holds q/k/v and gate/up fused. An adapter on the fused modules (what peft makes
    for Phi-3) matches peft; one on q_proj/k_proj/v_proj/gate_proj/up_proj (trained on an
    unfused copy) lands on slices of the fused outputs: it equals the fused adapter of rank
    3r (resp. 2r) whose A stacks the parts and whose B is block-diagonal."""
    from transformers import Phi3Config

    hf = make_tiny_model(tmp_path / "phi3", Phi3Config)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    # rank 12 on qkv, 8 on gate_up; alphas make every scaling 1.
    fused = _make_adapter(
        hf,
        tmp_path / "fused",
        4,
        r=12,
        lora_alpha=12,
        target_modules=targets,
        rank_pattern={"gate_up_proj": 8},
        alpha_pattern={"gate_up_proj": 8},
    )
    q = 4 * 16  # heads * head_dim of TINY_SHAPE
    kv = 2 * 16
    tensors = load_file(tmp_path / "fused" / "adapter_model.safetensors")
    split: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if ".qkv_proj.lora_A" in key:
            for i, leaf in enumerate(("q_proj", "k_proj", "v_proj")):
                split[key.replace("qkv_proj", leaf)] = t[4 * i : 4 * i + 4]
        elif ".qkv_proj.lora_B" in key:
            for i, (leaf, lo, n) in enumerate(
                (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv))
            ):
                block = t[lo : lo + n, 4 * i : 4 * i + 4].clone()
                t[lo : lo + n] = 0
                t[lo : lo + n, 4 * i : 4 * i + 4] = block  # the fused adapter is block-diagonal
                split[key.replace("qkv_proj", leaf)] = block
        elif ".gate_up_proj.lora_A" in key:
            split[key.replace("gate_up_proj", "gate_proj")] = t[:4]
            split[key.replace("gate_up_proj", "up_proj")] = t[4:]
        elif ".gate_up_proj.lora_B" in key:
            half = t.shape[0] // 2
            gate, up = t[:half, :4].clone(), t[half:, 4:].clone()
            t.zero_()
            t[:half, :4], t[half:, 4:] = gate, up
            split[key.replace("gate_up_proj", "gate_proj")] = gate
            split[key.replace("gate_up_proj", "up_proj")] = up
        else:
            split[key] = t
    save_file(tensors, tmp_path / "fused" / "adapter_model.safetensors")
    (tmp_path / "split").mkdir()
    save_file(split, tmp_path / "split" / "adapter_model.safetensors")
    cfg = json.loads((tmp_path / "fused" / "adapter_config.json").read_text())
    cfg.update(r=4, lora_alpha=4, target_modules=ALL)
    # o_proj and down_proj keep rank 12 (and scaling 1): peft's per-module patterns.
    cfg.update(rank_pattern={"o_proj|down_proj": 12}, alpha_pattern={"o_proj|down_proj": 12})
    (tmp_path / "split" / "adapter_config.json").write_text(json.dumps(cfg))

    want = (
        PeftModel.from_pretrained(_hf(tmp_path / "phi3"), tmp_path / "fused")
        .eval()(torch.tensor([IDS]))
        .logits[0]
    )
    m = _load(tmp_path / "phi3")
    base = m.logits(IDS)
    m.load_lora(tmp_path / "fused")
    m.load_lora(tmp_path / "split")
    assert (want - base).abs().max() > 0.1
    _close(m.engine.logits(IDS, loras={"fused": 1}), want.detach())
    _close(m.engine.logits(IDS, loras={"split": 1}), want.detach())
    del fused


def test_batch_of_mixed_adapters_equals_single_runs(tiny: Path, adapters: dict[str, Path]):
    """A, B, A+B at 0.5 and none in one batch give the tokens each gets alone (greedy),
    through the scheduler (continuous batching, chunked prefill, prefix cache on)."""
    m = _load(tiny, max_seq_len=128, cache_tokens=1024, page_size=8, prefill_chunk=16)
    m.load_lora(adapters["B"], name="X")  # slot 0 until it is unloaded mid-run
    m.load_lora(adapters["A"])
    m.load_lora(adapters["B"])
    # B replaces lm_head; at 0.5 its head is blended with the base's.
    selections = [{"A": 1.0}, {"B": 1.0}, {"A": 0.5, "B": 0.5}, {}]
    prompt = IDS + IDS[:5]  # > 2 pages: a shared prefix must not leak across selections
    single = []
    for loras in selections:
        chunks = list(m.stream(prompt, {**GREEDY, "loras": loras}))
        single.append([t for c in chunks for t in c.token_ids])
        # Same prompt, new selection: no page of another selection's K/V is reused.
        assert chunks[-1].cached_tokens == 0
    assert len({tuple(s) for s in single}) == 4, single  # every selection differs
    settings = [{**GREEDY, "loras": loras} for loras in selections]
    batched: dict[int, list[int]] = {i: [] for i in range(4)}
    for i, chunk in enumerate(m.stream_many([prompt] * 4, settings)):
        batched[chunk.job_id].extend(chunk.token_ids)
        if i == 6:  # hot unload and load between steps: A and B move to other slots
            assert m.unload_lora("X") is True
            m.load_lora(adapters["A"], name="Y")
    assert [batched[i] for i in range(4)] == single
    # The model-level selection applies to requests that name none.
    m.set_loras({"A": 1.0})
    chunks = list(m.stream(prompt, GREEDY))
    assert [t for c in chunks for t in c.token_ids] == single[0]
    assert chunks[-1].cached_tokens == 16  # the same selection reuses its own pages


def test_unload_frees_and_waits_for_running_jobs(tiny: Path, adapters: dict[str, Path]):
    m = _load(tiny, max_seq_len=128, cache_tokens=512, page_size=8)
    base = m.logits(IDS)
    m.load_lora(adapters["A"])
    m.load_lora(adapters["B"])
    engine = m.engine
    wrapped = [n for n, mod in engine.model.named_modules() if isinstance(mod, LoraLinear)]
    # Every linear of A (q/k/v and gate/up are one linear each when fused), lm_head for B.
    per_layer = 4 if hasattr(engine.model.model.layers[0].self_attn, "qkv_proj") else 7
    assert len(wrapped) == 2 * per_layer + 1
    ref = [t for c in m.stream(IDS, {**GREEDY, "loras": {"B": 1}}) for t in c.token_ids]

    adapter = weakref.ref(engine.loras.adapters["B"])
    head = weakref.ref(engine.loras.adapters["B"].replacements["lm_head"])
    job = engine.scheduler.submit(IDS, {**GREEDY, "loras": {"B": 1}})
    events = engine.scheduler.step()  # prefill + first token
    assert m.unload_lora("B") is False  # job still running: deferred
    assert m.loras()["B"]["unloading"] and m.loras()["B"]["in_use"] == 1
    with pytest.raises(LoraError, match="'B' is being unloaded"):
        engine.scheduler.submit(IDS, {"loras": {"B": 1}})
    events += list(engine.scheduler.stream(job))
    assert [t for e in events for t in e.token_ids] == ref
    assert "B" not in m.loras()
    gc.collect()
    assert adapter() is None and head() is None  # nothing holds B's tensors any more
    assert not isinstance(engine.model.lm_head, LoraLinear)

    assert m.unload_lora("A") is True
    assert not any(isinstance(mod, LoraLinear) for mod in engine.model.modules())
    torch.testing.assert_close(m.logits(IDS), base)
    with pytest.raises(LoraError, match="no LoRA adapter named 'A'"):
        m.set_loras({"A": 1})
    # The name can be reused: a reloaded adapter starts a fresh prefix-cache namespace.
    m.load_lora(adapters["B"], name="A")
    assert m.info()["loras"]["A"]["modules_to_save"] == ["lm_head"]


def _rewrite(src: Path, dst: Path, config=None, tensors=None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(config(cfg) if config else cfg))
    t = load_file(src / "adapter_model.safetensors")
    save_file(tensors(t) if tensors else t, dst / "adapter_model.safetensors")
    return dst


def test_bad_adapters_give_clear_errors(tiny: Path, adapters: dict[str, Path], tmp_path: Path):
    m = _load(tiny)
    a = adapters["A"]
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    with pytest.raises(LoraError, match="does not exist"):
        m.load_lora(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="adapter_config.json is missing"):
        m.load_lora(tmp_path / "empty")
    cases = {
        "another size": (
            None,
            lambda t: {**t, key: torch.randn(8, 96)},
            rf"'{key}' \(8, 96\).*in 64.*another model size",
        ),
        "another arch": (
            None,
            lambda t: {
                k.replace("self_attn.q_proj", "self_attn.qkv_proj"): v for k, v in t.items()
            },
            r"no linear 'model.layers.0.self_attn.qkv_proj'.*another architecture",
        ),
        "more layers": (
            None,
            lambda t: {k.replace("layers.1.", "layers.7."): v for k, v in t.items()},
            r"no linear 'model.layers.7.mlp.down_proj'.*layer count",
        ),
        "half a pair": (
            None,
            lambda t: {k: v for k, v in t.items() if "q_proj.lora_B" not in k},
            r"'.*layers.0.self_attn.q_proj.lora_A.weight' has no lora_B",
        ),
        "wrong rank": (lambda c: {**c, "r": 16}, None, r"rank 8, adapter_config.json says r=16"),
        "dora": (lambda c: {**c, "use_dora": True}, None, "DoRA adapters are not supported"),
        "not lora": (lambda c: {**c, "peft_type": "IA3"}, None, "'IA3' is not a LoRA adapter"),
        "bad alpha": (lambda c: {**c, "lora_alpha": "x"}, None, "'lora_alpha' must be a positive"),
    }
    for i, (name, (config, tensors, match)) in enumerate(cases.items()):
        bad = _rewrite(a, tmp_path / f"bad{i}", config, tensors)
        with pytest.raises(LoraError, match=match):
            m.load_lora(bad, name=name)
    (tmp_path / "nofile").mkdir()
    (tmp_path / "nofile" / "adapter_config.json").write_text(
        (a / "adapter_config.json").read_text()
    )
    with pytest.raises(LoraError, match="neither adapter_model.safetensors nor adapter_model.bin"):
        m.load_lora(tmp_path / "nofile")
    # Nothing was half-installed, and the model keeps serving.
    assert m.loras() == {}
    assert not any(isinstance(mod, LoraLinear) for mod in m.engine.model.modules())
    assert m.generate(IDS, {"max_new_tokens": 3, "temperature": 0}) is not None
    m.load_lora(a)
    with pytest.raises(LoraError, match="already loaded"):
        m.load_lora(a)
    with pytest.raises(LoraError, match="no LoRA adapter named 'C'"):
        m.generate(IDS, {"loras": {"C": 1}})
    with pytest.raises(SamplingSettingsError, match=r"loras\['A'\] must be a finite number"):
        SamplingSettings.from_any({"loras": {"A": "lots"}})
    assert SamplingSettings.from_any({"loras": ["A"]}).loras == {"A": 1.0}


@pytest.mark.gpu
def test_cuda_graph_lora_decode_equals_eager(tiny: Path, adapters: dict[str, Path], tmp_path):
    """With CUDA graphs on (default options), mixed-adapter decode steps give the tokens of
    an engine without graphs; loading another adapter mid-run is picked up. LoRA steps
    replay their own graphs when engine.engine.LORA_GRAPHS (the default of
    lora_cuda_graphs) is on; tests/test_lora_graphs.py covers them in detail."""
    from engine.engine import LORA_GRAPHS

    c = _make_adapter(_hf(tiny), tmp_path / "C", 5, r=16, lora_alpha=16, target_modules=ALL)
    del c
    selections = [{"A": 1.0}, {"C": 1.0}, {"A": 0.5, "C": 0.5}, {}]
    settings = [{**GREEDY, "max_new_tokens": 24, "loras": s} for s in selections]
    runs = {}
    for graphs in (False, True):
        m = loader.load(tiny, "kestrel", device="cuda", dtype="float16", cuda_graphs=graphs)
        m.load_lora(adapters["A"])
        m.load_lora(tmp_path / "C")
        out: dict[int, list[int]] = {i: [] for i in range(4)}
        for i, chunk in enumerate(m.stream_many([IDS] * 4, settings)):
            out[chunk.job_id].extend(chunk.token_ids)
            if i == 20:  # hot load while the jobs decode
                m.load_lora(adapters["B"])
        runs[graphs] = [out[i] for i in range(4)]
        if graphs:
            assert bool(m.engine.graphs._lora_graphs) == LORA_GRAPHS
        m.unload()
    assert runs[True] == runs[False]
    assert len({tuple(r) for r in runs[True]}) == 4


@pytest.mark.gpu
def test_unload_frees_gpu_memory(tiny: Path, tmp_path: Path):
    # Engines of earlier tests that a reference cycle still holds would be freed by some
    # later automatic collection, in the middle of the comparisons below.
    gc.collect()
    torch.cuda.empty_cache()
    m = loader.load(tiny, "kestrel", device="cuda", dtype="float16")
    before = torch.cuda.memory_allocated()
    big = _make_adapter(_hf(tiny), tmp_path / "big", 6, r=64, lora_alpha=64, target_modules=ALL)
    del big
    m.load_lora(tmp_path / "big")
    assert torch.cuda.memory_allocated() > before
    assert m.unload_lora("big") is True
    gc.collect()
    # <=: unloading may also free what the first adapter load replaced (empty stacks).
    assert torch.cuda.memory_allocated() <= before
    # LoRA decode graphs are freed with the adapters they were captured for.
    m.load_lora(tmp_path / "big")
    m.generate(IDS, {**GREEDY, "loras": {"big": 1.0}})
    assert m.engine.graphs._lora_graphs
    m.unload_lora("big")
    assert not m.engine.graphs._lora_graphs


def test_transformers_loader_loras_through_peft(tiny: Path, adapters: dict[str, Path]):
    """The reference loader offers the same calls through peft, one selection for all."""
    hf = loader.load(tiny, "transformers", device="cpu", dtype="float32")
    kestrel = _load(tiny)
    base = hf.logits(IDS)
    for m in (hf, kestrel):
        m.load_lora(adapters["A"])
        m.load_lora(adapters["B"])
        m.set_loras({"A": 0.5, "B": 1.0})
    _close(hf.logits(IDS), kestrel.logits(IDS))
    assert set(hf.info()["loras"]) == {"A", "B"}
    with pytest.raises(LoraError, match="per-request LoRA needs the kestrel loader"):
        hf.generate(IDS, {"loras": {"A": 1.0}})
    hf.set_loras({})
    _close(hf.logits(IDS), base)
    assert hf.unload_lora("A") and hf.unload_lora("B")
    _close(hf.logits(IDS), base)
    assert hf.loras() == {}


def test_cli_applies_loras(tiny: Path, adapters: dict[str, Path], capsys):
    from loader.__main__ import main

    settings = {"max_new_tokens": 6, "temperature": 0.0, "do_sample": False}
    want = _load(tiny)
    want.load_lora(adapters["A"])
    want.load_lora(adapters["B"])
    text = want.generate("The quick", {**settings, "loras": {"A": 0.5, "B": 1.0}})
    assert text != want.generate("The quick", {**settings, "loras": {}})
    argv = [str(tiny), "-p", "The quick", "-n", "6", "--device", "cpu", "--dtype", "float32"]
    assert main([*argv, "--lora", f"{adapters['A']}=0.5", "--lora", str(adapters["B"])]) == 0
    assert capsys.readouterr().out == text
    assert main([*argv, "--lora", str(adapters["A"].parent / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_hot_load_from_another_thread_while_streaming(tiny: Path, adapters: dict[str, Path]):
    import threading

    m = _load(tiny, max_seq_len=128, cache_tokens=512, page_size=8)
    m.load_lora(adapters["A"])
    settings = {**GREEDY, "max_new_tokens": 24, "loras": {"A": 1.0}}
    ref = [t for c in m.stream(IDS, settings) for t in c.token_ids]
    got: list[int] = []
    started = threading.Event()

    def consume() -> None:
        for chunk in m.stream(IDS, settings):
            got.extend(chunk.token_ids)
            started.set()

    thread = threading.Thread(target=consume)
    thread.start()
    started.wait(timeout=60)
    for _ in range(3):  # load, select, unload: the running job keeps its own selection
        m.load_lora(adapters["B"])
        m.set_loras({"B": 1.0})
        assert m.unload_lora("B") is True
    thread.join(timeout=120)
    assert got == ref
