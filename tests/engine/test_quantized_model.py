"""Whole models stored as EXL2 or GPTQ: Kestrel's logits equal those of transformers running
the same model with the dequantized weights; corrupt packed tensors fail at load by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import loader
from engine import quantized_linear
from engine.quant.checks import QuantFormatError
from engine.quant.exl2 import Exl2Tensors
from helpers.model_factory import make_tiny_llama
from helpers.quantized import exl2_quantize, gptq_quantize, quantize_model


def _ids(n: int = 48) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def fp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fp")
    make_tiny_llama(path)
    return path


def test_exl2_model_matches_dequantized_reference(fp_model: Path, tmp_path: Path, device: str):
    ref = quantize_model(fp_model, tmp_path / "exl2", exl2_quantize)
    m = loader.load(tmp_path / "exl2", "kestrel", device=device, dtype="float32")
    ids = _ids()
    expected = ref(torch.tensor([ids])).logits[0]
    got = m.logits(ids)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-4
    assert "QuantizedLinear" in repr(m.engine.model.model.layers[0].mlp.down_proj.__class__)


@pytest.mark.parametrize(
    "bits,group,sym,act_order,v2",
    [(4, 32, True, True, False), (4, -1, False, False, True), (8, 64, False, True, False)],
)
def test_gptq_model_matches_dequantized_reference(
    fp_model: Path, tmp_path: Path, bits: int, group: int, sym: bool, act_order: bool, v2: bool
):
    quantize = gptq_quantize(bits, group, sym, act_order, v2)
    ref = quantize_model(fp_model, tmp_path / "gptq", quantize)
    cfg_path = tmp_path / "gptq" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": act_order,
        "sym": sym,
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
    }
    cfg_path.write_text(json.dumps(cfg))
    m = loader.load(tmp_path / "gptq", "kestrel", device="cpu", dtype="float32")
    ids = _ids()
    expected = ref(torch.tensor([ids])).logits[0]
    assert ((m.logits(ids) - expected).abs().max() / expected.abs().max()).item() < 1e-4
    assert m.generate(ids[:8], {"max_new_tokens": 4, "temperature": 0}) is not None


def _corrupt(path: Path, name: str, value: torch.Tensor) -> None:
    tensors = load_file(path / "model.safetensors")
    tensors[name] = value
    save_file(tensors, path / "model.safetensors")


def test_corrupt_exl2_tensors_fail_at_load_by_name(fp_model: Path, tmp_path: Path, device: str):
    # On a GPU the tensors are validated and repacked there (load_quantized_linear):
    # the same errors, naming the same tensors.
    quantize_model(fp_model, tmp_path / "q", exl2_quantize)
    path = tmp_path / "q"
    original = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj"

    groups = original[f"{name}.q_groups"].clone()
    groups[0], groups[2] = groups[2].item(), groups[0].item()  # bits no longer non-increasing
    _corrupt(path, f"{name}.q_groups", groups)
    with pytest.raises(QuantFormatError, match=f"{name}"):
        loader.load(path, "kestrel", device=device)

    _corrupt(path, f"{name}.q_groups", original[f"{name}.q_groups"])
    invperm = original[f"{name}.q_invperm"].clone()
    invperm[0] = invperm[1]
    _corrupt(path, f"{name}.q_invperm", invperm)
    with pytest.raises(QuantFormatError, match=f"{name}.q_invperm"):
        loader.load(path, "kestrel", device=device)

    _corrupt(path, f"{name}.q_invperm", original[f"{name}.q_invperm"])
    _corrupt(path, f"{name}.q_weight", original[f"{name}.q_weight"][:-1])
    with pytest.raises(QuantFormatError, match=rf"{name}\.q_\w+: .*q_weight has 11 rows"):
        loader.load(path, "kestrel", device=device)

    _corrupt(path, f"{name}.q_weight", original[f"{name}.q_weight"])
    groups = original[f"{name}.q_groups"].clone()
    groups[0] = 7
    _corrupt(path, f"{name}.q_groups", groups)
    with pytest.raises(QuantFormatError, match=f"{name}.q_groups"):
        loader.load(path, "kestrel", device=device)


@pytest.mark.gpu
def test_gpu_repack_out_of_memory_falls_back_to_the_cpu(
    fp_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Linears are repacked on the target GPU; one whose repack runs out of GPU memory (the
    # error injected into every other linear's GPU attempt) is repacked on the CPU instead,
    # lands on the GPU all the same and gives the same logits.
    ref = quantize_model(fp_model, tmp_path / "q", exl2_quantize)
    real = quantized_linear.exl2_to_runtime
    works: list[str] = []

    def repack(exl2: Exl2Tensors):
        works.append(exl2.q_weight.device.type)
        if exl2.q_weight.is_cuda and works.count("cuda") % 2 == 1:
            raise torch.cuda.OutOfMemoryError("injected")
        return real(exl2)

    monkeypatch.setattr(quantized_linear, "exl2_to_runtime", repack)
    m = loader.load(tmp_path / "q", "kestrel", device="cuda", dtype="float32")
    assert "cpu" in works and works.count("cpu") == (works.count("cuda") + 1) // 2
    linears = [
        q for q in m.engine.model.modules() if isinstance(q, quantized_linear.QuantizedLinear)
    ]
    assert linears and all(q.qweight.scales.is_cuda for q in linears)
    assert all(p.packed.is_cuda for q in linears for g in q.qweight.segments for p in g.planes)
    ids = _ids()
    expected = ref(torch.tensor([ids])).logits[0]
    got = m.logits(ids).cpu()
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-4
    m.unload()


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager(fp_model: Path, tmp_path: Path):
    """Greedy decode through the captured graphs gives the eager path's tokens and logits."""
    quantize_model(fp_model, tmp_path / "q", exl2_quantize)
    ids = _ids(20)
    settings = {"max_new_tokens": 40, "temperature": 0, "ban_eos_token": True}
    runs = {}
    for graphs in (False, True):
        m = loader.load(tmp_path / "q", "kestrel", device="cuda", cuda_graphs=graphs)
        assert (m.engine.graphs is not None) == graphs
        runs[graphs] = [t for c in m.stream(ids, settings) for t in c.token_ids]
        assert m.engine.cache.free_pages == m.engine.cache.num_pages  # graphs take no page
        m.unload()
    assert runs[True] == runs[False] and len(runs[True]) == 40
