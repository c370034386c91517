"""LoRA tests' shared pieces: peft adapters with random non-zero weights, the
transformers reference, the linears they target and a greedy setting."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


IDS = [5, 17, 99, 203, 11, 42, 300, 7, 64, 128, 250, 31, 77, 190, 3, 360]


GREEDY = {"temperature": 0, "ban_eos_token": True, "max_new_tokens": 8}


def make_adapter(base: torch.nn.Module, path: Path, seed: int, **config) -> torch.nn.Module:
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


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
