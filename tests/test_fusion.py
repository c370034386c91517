"""engine.fusion: q/k/v and gate/up fused at load give the same logits as separate linears."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_quantized_model import _gptq, _quantize_model

from engine.engine import Engine, EngineOptions
from engine.fusion import concat_linears
from engine.quant.exl2 import Exl2Tensors, dequantize_exl2
from engine.quant.exl2_writer import quantize_rtn_exl2

from model_factory import make_tiny_llama

IDS = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64]


@pytest.fixture(scope="module")
def fp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fp")
    make_tiny_llama(path)
    return path


def _engines(path: Path) -> tuple[Engine, Engine]:
    opts = dict(device="cpu", dtype="float32", max_seq_len=64)
    return (
        Engine.load(path, EngineOptions(**opts, fuse_projections=True)),
        Engine.load(path, EngineOptions(**opts, fuse_projections=False)),
    )


def _assert_same_logits(fused: Engine, plain: Engine) -> None:
    torch.testing.assert_close(fused.logits(IDS), plain.logits(IDS), rtol=1e-5, atol=1e-5)


def _layer0(engine: Engine) -> torch.nn.Module:
    return engine.model.model.layers[0]


def test_dense_model_fuses_and_matches(fp_model: Path) -> None:
    fused, plain = _engines(fp_model)
    layer = _layer0(fused)
    assert hasattr(layer.self_attn, "qkv_proj") and not hasattr(layer.self_attn, "q_proj")
    assert layer.mlp.gate_up_proj is not None and not hasattr(layer.mlp, "gate_proj")
    assert not hasattr(_layer0(plain).self_attn, "qkv_proj")
    _assert_same_logits(fused, plain)


def test_gptq_model_fuses_and_matches(fp_model: Path, tmp_path: Path) -> None:
    _quantize_model(fp_model, tmp_path / "gptq", _gptq(4, 32, True, False, False))
    cfg_path = tmp_path / "gptq" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                  "desc_act": False, "sym": True}  # fmt: skip
    cfg_path.write_text(json.dumps(cfg))
    fused, plain = _engines(tmp_path / "gptq")
    layer = _layer0(fused)
    assert type(layer.self_attn.qkv_proj).__name__ == "QuantizedLinear"
    assert layer.mlp.gate_up_proj.out_features == 2 * layer.mlp.down_proj.in_features
    _assert_same_logits(fused, plain)


def _exl2_same_layout(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """EXL2 where the linears sharing an input share the permutation (as a converter makes
    them, from one Hessian); o_proj/down_proj get their own."""
    k = w.shape[1]
    shared = module.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    seed = (k if shared else k + 1) + (7 if "mlp" in module else 0)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    groups = -(-k // 32)
    bits = [6] * (groups // 2) + [5] * (groups - groups // 2)  # non-increasing, as EXL2's
    packed = quantize_rtn_exl2(w, bits, 32, perm=perm)
    return packed, dequantize_exl2(Exl2Tensors.from_dict(packed)).t()


def test_exl2_fuses_when_layouts_match(fp_model: Path, tmp_path: Path) -> None:
    _quantize_model(fp_model, tmp_path / "exl2", _exl2_same_layout)
    fused, plain = _engines(tmp_path / "exl2")
    assert hasattr(_layer0(fused).self_attn, "qkv_proj")
    assert _layer0(fused).mlp.gate_up_proj is not None
    _assert_same_logits(fused, plain)


def test_different_layouts_are_not_fused(fp_model: Path, tmp_path: Path) -> None:
    def varied(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        k = w.shape[1]
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(len(module)))
        bits = [8 if "k_proj" in module else 4] * -(-k // 32)
        packed = quantize_rtn_exl2(w, bits, 32, perm=perm)
        return packed, dequantize_exl2(Exl2Tensors.from_dict(packed)).t()

    _quantize_model(fp_model, tmp_path / "exl2", varied)
    fused, plain = _engines(tmp_path / "exl2")
    attn = _layer0(fused).self_attn
    assert hasattr(attn, "q_proj") and not hasattr(attn, "qkv_proj")
    assert concat_linears([attn.q_proj, attn.k_proj]) is None
    _assert_same_logits(fused, plain)


def test_the_plan_builds_fused_modules_before_any_weight(fp_model: Path) -> None:
    """The build plan decides from the checkpoint: the model comes out of its constructor
    (on the meta device, no weight read) with qkv_proj / gate_up_proj and no parts, each
    fused module naming its parts for the loader; LoRA then targets the parts' names only
    (an adapter names what the checkpoint stores)."""
    from engine.architectures import architecture_class
    from engine.build_plan import plan_build
    from engine.config import ModelConfig
    from engine.lora import lora_targets
    from engine.weights import WeightStore

    config = ModelConfig.from_dir(fp_model)
    store = WeightStore(fp_model)
    with torch.device("meta"):
        model = architecture_class(config.architecture)(
            config, plan=plan_build(store, fuse_kernels=False)
        )
    layer = model.model.layers[0]
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    assert layer.self_attn.load_sources == {
        "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
    }
    inter = config.intermediate_size
    assert layer.mlp.load_sources == {"gate_up_proj": (("gate_proj", inter), ("up_proj", inter))}
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")
    assert not any(m.fuse_kernels for m in model.modules() if hasattr(m, "fuse_kernels"))
    targets = lora_targets(model)
    assert targets["model.layers.0.self_attn.k_proj"].linear.endswith("qkv_proj")
    assert "model.layers.0.self_attn.qkv_proj" not in targets
    assert "model.layers.0.mlp.gate_up_proj" not in targets
    unfused = plan_build(store, fuse_projections=False)
    with torch.device("meta"):
        plain = architecture_class(config.architecture)(config, plan=unfused)
    assert plain.model.layers[0].self_attn.load_sources == {}
    assert hasattr(plain.model.layers[0].self_attn, "q_proj")
