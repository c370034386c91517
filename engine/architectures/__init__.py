"""Architecture registry: HF `architectures` name -> the class that builds it.

An unknown name is refused with the list of supported ones; nothing is ever loaded "as
Llama" on a guess.
"""

from __future__ import annotations

from engine.architectures.base import CausalLM
from engine.architectures.llama import LlamaForCausalLM

_CLASSES: list[type[CausalLM]] = [LlamaForCausalLM]
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
