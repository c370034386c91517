"""LoRA adapters: PEFT adapters read from disk (adapter.py), applied unmerged and per
request on any linear format (layers.py, kernels/lora_matmul.py), managed per engine with
hot load and unload (manager.py)."""

from engine.lora.adapter import LoraAdapter, LoraError, read_adapter
from engine.lora.batch import LoraBatch, LoraSegments
from engine.lora.layers import LoraEmbedding, LoraLinear
from engine.lora.manager import LoraManager, lora_targets

__all__ = [
    "LoraAdapter",
    "LoraBatch",
    "LoraEmbedding",
    "LoraError",
    "LoraLinear",
    "LoraManager",
    "LoraSegments",
    "lora_targets",
    "read_adapter",
]
