"""TGW's `modules.shared`: the same objects as serving.shared, under TGW's names.

`model`, `tokenizer`, `model_name`, `args` and `settings` are looked up on each access
(the user may load another model at any time, ui.py replaces `args` at start-up)."""

from __future__ import annotations

import sys
import types
from typing import Any

from serving import shared as _shared

default_settings: dict[str, Any] = {}
gradio: dict[str, Any] = {}  # TGW's registry of UI components; extensions may add to it


class _SharedModule(types.ModuleType):
    """This module's type: `stop_everything` is a property, so an extension's
    `shared.stop_everything = True` (TGW's way to stop generation) stops the UI's replies
    instead of setting a flag that nothing reads."""

    @property
    def stop_everything(self) -> bool:
        return _shared.stop_everything

    @stop_everything.setter
    def stop_everything(self, value: bool) -> None:
        if value:
            _shared.request_stop_everything()
        else:
            _shared.stop_everything = False


sys.modules[__name__].__class__ = _SharedModule


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
