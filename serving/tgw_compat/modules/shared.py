"""TGW's `modules.shared`: the same objects as serving.shared, under TGW's names.

`model`, `tokenizer`, `model_name`, `args` and `settings` are looked up on each access
(the user may load another model at any time, ui.py replaces `args` at start-up)."""

from __future__ import annotations

from typing import Any

from serving import shared as _shared

default_settings: dict[str, Any] = {}
gradio: dict[str, Any] = {}  # TGW's registry of UI components; extensions may add to it
stop_everything = False


def __getattr__(name: str) -> Any:
    manager = _shared.manager
    if name in ("args", "settings"):
        return getattr(_shared, name)
    if name == "model":
        return manager.current() if manager.is_loaded() else None
    if name == "tokenizer":
        return manager.current().tokenizer if manager.is_loaded() else None
    if name == "model_name":
        return manager.name or "None"
    raise AttributeError(f"module 'modules.shared' (Kestrel's TGW shim) has no attribute {name!r}")
