"""Architecture registry: HF `architectures` name -> the class that builds it.

An unknown name is refused with the list of supported ones; nothing is ever loaded "as
Llama" on a guess.
"""

from __future__ import annotations

from engine.architectures.base import CausalLM
from engine.architectures.gemma2 import Gemma2ForCausalLM
from engine.architectures.gemma3 import Gemma3ForCausalLM
from engine.architectures.llama import LlamaForCausalLM
from engine.architectures.mixtral import MixtralForCausalLM
from engine.architectures.phi3 import Phi3ForCausalLM
from engine.architectures.qwen2 import Qwen2ForCausalLM
from engine.architectures.qwen3 import Qwen3ForCausalLM
from engine.architectures.qwen3_moe import Qwen3MoeForCausalLM

_CLASSES: list[type[CausalLM]] = [
    LlamaForCausalLM,
    MixtralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    Phi3ForCausalLM,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
]
ARCHITECTURES: dict[str, type[CausalLM]] = {
    name: cls for cls in _CLASSES for name in cls.architectures
}


class UnsupportedArchitectureError(ValueError):
    pass


def architecture_class(name: str, *, source: str = "config.json") -> type[CausalLM]:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"{source}: architecture '{name}' is not supported by Kestrel "
            f"(supported: {', '.join(sorted(ARCHITECTURES))}); "
            "the 'transformers' loader may run it"
        ) from None


__all__ = ["ARCHITECTURES", "CausalLM", "UnsupportedArchitectureError", "architecture_class"]
