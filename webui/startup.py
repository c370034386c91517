"""Which model ui.py loads before serving, so that `python ui.py` alone gives a working chat.

Order: --model (a name in the models directory, or a path anywhere); else the model loaded
last time (settings.yaml), if it is still there; else the default model if it is already
prepared; else, when the models directory holds no model at all, the default model is
prepared (downloaded once, imported and converted to EXL2 4.0 bpw: a few minutes on a
small CPU) and loaded. With other models present and
nothing remembered, nothing is loaded: the user picks one in the Model tab.

A failure to load is reported and the UI starts anyway (the Model tab shows the list).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import loader
from loader.default_model import (
    DEFAULT_MODEL,
    DEFAULT_MODEL_DIRNAME,
    ensure_default_model,
    packaged_model,
)
from loader.manager import ModelManager
from webui.cli import load_options
from webui.context import AppContext


def _say(message: str) -> None:
    print(f"[kestrel ui] {message}", file=sys.stderr, flush=True)


def pick_model(
    args: argparse.Namespace, manager: ModelManager, remembered: dict[str, Any]
) -> tuple[str | None, str | None]:
    """(name in the models dir, None) or (None, path) to load, or (None, None) for nothing."""
    if args.model:
        if Path(args.model).name == args.model and (manager.models_dir / args.model).exists():
            return args.model, None
        if Path(args.model).expanduser().exists():
            return None, str(Path(args.model).expanduser())
        raise SystemExit(
            f"--model {args.model}: neither a model in {manager.models_dir} nor an existing path"
        )
    if args.no_default_model:
        return None, None
    names = [e.name for e in manager.list_models()]
    last = remembered.get("model")
    if isinstance(last, str) and last in names:
        return last, None
    if DEFAULT_MODEL_DIRNAME in names:
        return DEFAULT_MODEL_DIRNAME, None
    # Nothing there but (maybe) the default model's FP16 import: prepare its EXL2 form.
    if not [n for n in names if n != packaged_model(DEFAULT_MODEL).dirname]:
        _say(f"no model in {manager.models_dir}: preparing the default model (once)")
        ensure_default_model(manager.models_dir, threads=args.threads)
        return DEFAULT_MODEL_DIRNAME, None
    return None, None


def load_initial_model(
    args: argparse.Namespace, manager: ModelManager, remembered: dict[str, Any]
) -> None:
    name, path = pick_model(args, manager, remembered)
    if name is None and path is None:
        _say("no model loaded; choose one in the Model tab")
        return
    # Flags win; without any, the options the remembered model was loaded with.
    options = load_options(args)
    if name == remembered.get("model") and not _flags_given(args):
        options = dict(remembered.get("load_options") or options)
    loader_name = args.loader or (
        remembered.get("loader") if name == remembered.get("model") else None
    )
    try:
        if name is not None:  # the manager's progress says "loading <name>"
            manager.load(name, loader_name, progress=_say, **options)
        else:
            assert path is not None
            _say(f"loading {path} ...")
            manager.adopt(loader.load(path, loader_name, **options), Path(path).name)
    except Exception as e:  # the UI still starts, and shows the list to choose from
        _say(f"could not load {name or path}: {e}")
        return
    _say(f"loaded {manager.name}")


def _flags_given(args: argparse.Namespace) -> bool:
    return bool(load_options(args)) or bool(args.loader)


def apply_startup_loras(args: argparse.Namespace, ctx: AppContext) -> None:
    """--lora NAME...: apply these adapters (scale 1) to the model loaded at start."""
    if not args.lora:
        return
    if not ctx.manager.is_loaded():
        _say(f"--lora {' '.join(args.lora)}: no model is loaded, so no LoRA is applied")
        return
    model = ctx.manager.current()
    with ctx.loras.lock:
        scales = ctx.loras.for_model(model)
        try:
            for name in args.lora:
                model.load_lora(ctx.manager.resolve_lora(name), name)
                scales[name] = 1.0
            model.set_loras(dict(scales))
        except Exception as e:  # shown; the UI starts without them
            _say(f"could not apply LoRA(s) {', '.join(args.lora)}: {e}")
            return
    _say(f"applied LoRA(s): {', '.join(args.lora)}")
