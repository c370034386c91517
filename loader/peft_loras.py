"""LoRA for the transformers loader, through peft itself (the reference implementation).

Only a model-level selection: `set_loras({name: scale})` activates those adapters at those
scales for every request (peft has no per-request adapters); a request whose settings name
another selection is refused. Adapters are checked by peft, not by engine/lora.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.lora import LoraError
from engine.lora.adapter import read_config


class PeftLoras:
    def __init__(self) -> None:
        self.paths: dict[str, Path] = {}
        self.scales: dict[str, float] = {}

    def load(self, model: Any, path: str | Path, name: str | None) -> tuple[Any, str]:
        """Returns the (possibly newly wrapped) model and the adapter's name."""
        from peft import PeftModel

        path = Path(path).expanduser()
        name = name or path.name
        if name in self.paths:
            raise LoraError(f"an adapter named '{name}' is already loaded; unload it first")
        read_config(path)  # the same clear errors as the kestrel loader for a bad directory
        try:
            if isinstance(model, PeftModel):
                model.load_adapter(str(path), adapter_name=name)
            else:
                model = PeftModel.from_pretrained(model, str(path), adapter_name=name)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise LoraError(f"peft could not load the adapter {path}: {e}") from e
        self.paths[name] = path
        self._apply(model)
        return model.eval(), name

    def set(self, model: Any, scales: Mapping[str, float]) -> None:
        unknown = [n for n in scales if n not in self.paths]
        if unknown:
            raise LoraError(
                f"no LoRA adapter named {unknown[0]!r} is loaded "
                f"(loaded: {', '.join(self.paths) or 'none'})"
            )
        self.scales = {n: float(s) for n, s in scales.items() if s}
        self._apply(model)

    def unload(self, model: Any, name: str) -> Any:
        """Returns the model, unwrapped from peft when no adapter is left."""
        if name not in self.paths:
            raise LoraError(f"no LoRA adapter named '{name}' is loaded")
        del self.paths[name]
        self.scales.pop(name, None)
        model.delete_adapter(name)
        if not self.paths:
            return model.unload()
        self._apply(model)
        return model

    def check_request(self, selection: Mapping[str, float] | None) -> None:
        if selection is not None and {n: s for n, s in selection.items() if s} != self.scales:
            raise LoraError(
                "the transformers loader applies one LoRA selection to every request: "
                "call set_loras() (per-request LoRA needs the kestrel loader)"
            )

    def _apply(self, model: Any) -> None:
        if not self.scales:
            model.base_model.disable_adapter_layers()
            return
        model.base_model.enable_adapter_layers()
        model.base_model.set_adapter(list(self.scales))
        for module in model.modules():
            if hasattr(module, "set_scale"):
                for name, scale in self.scales.items():
                    module.set_scale(name, scale)

    def info(self) -> dict[str, dict[str, Any]]:
        return {
            n: {"path": str(p), "scale": self.scales.get(n, 0.0)} for n, p in self.paths.items()
        }
