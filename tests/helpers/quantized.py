"""Whole checkpoints quantized to EXL2 or GPTQ (round to nearest) with their dequantized
transformers reference: the quantized-model, fusion, LoRA and tensor-parallel tests share them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.quant.exl2 import Exl2Tensors, dequantize_exl2
from engine.quant.exl2_writer import quantize_rtn_exl2
from engine.quant.gptq import GptqTensors, dequantize_gptq, quantize_rtn_gptq

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def exl2_bits(k: int) -> list[int]:
    """A mixed, non-increasing bit list over 32-row groups."""
    widths = [8, 6, 5, 4, 3, 2]
    groups = -(-k // 32)
    return [widths[min(i * len(widths) // groups, len(widths) - 1)] for i in range(groups)]


def quantize_model(
    src: Path, dst: Path, quantize: Callable[[str, torch.Tensor], tuple[dict, torch.Tensor]]
) -> torch.nn.Module:
    """Quantize every linear (and the head) of the checkpoint in `src` into `dst`; returns
    the HF model with the dequantized weights put back, the reference."""
    from transformers import LlamaForCausalLM

    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and (module.split(".")[-1] in LINEARS or module == "lm_head"):
            packed, w = quantize(module, t)
            out.update({f"{module}.{k}": v for k, v in packed.items()})
            dequantized[name] = w
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    ref = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = ref.state_dict()
    state.update(dequantized)
    ref.load_state_dict(state)
    return ref.eval()


def exl2_quantize(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    k = w.shape[1]
    g = torch.Generator().manual_seed(hash(module) % 1000)
    perm = torch.randperm(k, generator=g)
    packed = quantize_rtn_exl2(w, exl2_bits(k), 32, perm=perm)
    return packed, dequantize_exl2(Exl2Tensors.from_dict(packed)).t()


def gptq_quantize(bits: int, group: int, sym: bool, act_order: bool, v2: bool):
    def quantize(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        packed = quantize_rtn_gptq(w, bits, group, sym=sym, act_order=act_order, v2=v2)
        t = GptqTensors.from_dict(packed, bits=bits, checkpoint_format="gptq_v2" if v2 else "gptq")
        return packed, dequantize_gptq(t).t()

    return quantize
