"""A tiny Llama whose layers mix FP16, EXL2 and GPTQ: the tensor-parallel, placement and
multi-GPU tests shard and split it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .model_factory import make_tiny_llama
from .quantized import exl2_quantize, gptq_quantize

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def mixed_quantize(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Layer 0 and the head stay FP16; layer 1 has EXL2 attention and a GPTQ (act-order)
    MLP, layer 2 the other way round: one model covers every format on both axes."""
    if not module.startswith("model.layers.") or module.split(".")[2] == "0":
        return {"weight": w}, w.float()
    w = w.float()
    use_exl2 = (module.split(".")[2] == "1") == ("self_attn" in module)
    if use_exl2:
        return exl2_quantize(module, w)
    return gptq_quantize(4, 32, False, True, False)(module, w)


def quantize_checkpoint(src: Path, dst: Path, quantize) -> Path:
    """Copy the checkpoint in `src` to `dst`, each linear and the head replaced by what
    `quantize(module, weight)` writes (test_quantized_model's writers), without building a
    transformers reference."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(src / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and (module.split(".")[-1] in LINEARS or module == "lm_head"):
            out.update({f"{module}.{k}": v for k, v in quantize(module, t)[0].items()})
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def build_mixed_model(root: Path) -> Path:
    """A 3-layer tiny Llama under root/q with FP16, EXL2 and GPTQ layers (mixed_quantize)."""
    make_tiny_llama(root / "fp16", dtype=torch.float16, num_hidden_layers=3)
    path = quantize_checkpoint(root / "fp16", root / "q", mixed_quantize)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (path / "config.json").write_text(json.dumps(cfg))
    return path
