"""Which model ui.py loads before serving, so that `python ui.py` alone gives a working chat.

Order: --model (a name in the models directory, or a path anywhere); else the model loaded
last time (settings.yaml), if it is still there; else the default model if it is already
prepared; else, when the models directory holds no model at all, the default model is
prepared (downloaded once, imported and converted to EXL2 4.0 bpw: a few minutes on a
small CPU) and loaded. With other models present and
nothing remembered, nothing is loaded: the user picks one in the Model tab.

A failure to load is reported and the UI starts anyway (the Model tab shows the list).

Preparing the default model takes minutes on a small CPU, so when ui.py serves a page it
runs in the background (`start_preparing`) and the page is served at once, showing
`preparation_status()` until the model is loaded.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
from webui.load_check import check_load


def _say(message: str) -> None:
    print(f"[kestrel ui] {message}", file=sys.stderr, flush=True)


def pick_model(
    args: argparse.Namespace,
    manager: ModelManager,
    remembered: dict[str, Any],
    stage: Callable[[str], None] | None = None,
) -> tuple[str | None, str | None]:
    """(name in the models dir, None) or (None, path) to load, or (None, None) for nothing.
    Preparing the default model tells `stage` where it is (download, each conversion bar)."""
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
    if needs_default_model(manager):
        _say(f"no model in {manager.models_dir}: preparing the default model (once)")
        ensure_default_model(manager.models_dir, threads=args.threads, listener=stage)
        return DEFAULT_MODEL_DIRNAME, None
    return None, None


def needs_default_model(manager: ModelManager) -> bool:
    """True when the models directory holds no model but (maybe) the default model's FP16
    import: the default model is then prepared at start."""
    names = [e.name for e in manager.list_models()]
    return not [n for n in names if n != packaged_model(DEFAULT_MODEL).dirname]


def prepare_while_serving(args: argparse.Namespace, manager: ModelManager) -> bool:
    """True when the default model is to be prepared and a page can show its progress."""
    if args.model or args.no_default_model or args.nowebui:
        return False
    return needs_default_model(manager)


@dataclass
class Preparation:
    """The default model's preparation running in the background (see start_preparing)."""

    started: float = field(default_factory=time.monotonic)
    stage: str = "preparing the default model"
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


_preparation: Preparation | None = None


def preparation_status() -> str | None:
    """A line for the page while the default model is prepared; None when there is none
    (never started, or finished and loaded)."""
    prep = _preparation
    if prep is None or (prep.done.is_set() and prep.error is None):
        return None
    if prep.error is not None:
        return f"Preparing the default model failed: {prep.error}"
    minutes, seconds = divmod(int(time.monotonic() - prep.started), 60)
    return (
        f"Preparing the default model {DEFAULT_MODEL} (download and conversion, once; a few "
        f"minutes on a small CPU): {prep.stage}. {minutes} min {seconds:02d} s so far; "
        "the chat works as soon as it is loaded."
    )


def track_progress_bars() -> None:
    """Install Gradio's tqdm tracking now, before any bar is open. Gradio patches tqdm's
    class the first time a handler asks to track bars (`gr.Progress(track_tqdm=True)`, which
    the Model tab's download panel creates while the page is built); a bar opened before
    that and updated after fails with AttributeError ('_progress'). The default model's
    conversion, running while the page was built, died that way at random (the race)."""
    from gradio.helpers import patch_tqdm

    patch_tqdm()


def start_preparing(
    args: argparse.Namespace, manager: ModelManager, remembered: dict[str, Any]
) -> Preparation:
    """Prepare and load the default model in a thread; the page is served meanwhile."""
    global _preparation
    track_progress_bars()  # the thread's bars outlive the page's build
    prep = Preparation()
    _preparation = prep

    def report(message: str) -> None:
        prep.stage = message
        _say(message)

    def stage(message: str) -> None:  # every bar update: the page only, not the terminal
        prep.stage = message

    def work() -> None:
        try:
            prep.stage = "downloading and converting"
            load_initial_model(args, manager, remembered, progress=report, stage=stage)
            if not manager.is_loaded():
                prep.error = "the model did not load (the terminal says why)"
        except Exception as e:  # shown in the page and said here; the UI goes on
            prep.error = str(e) or type(e).__name__
            _say(f"could not prepare the default model: {prep.error}")
        finally:
            prep.done.set()

    threading.Thread(target=work, name="prepare-default-model", daemon=True).start()
    return prep


def load_initial_model(
    args: argparse.Namespace,
    manager: ModelManager,
    remembered: dict[str, Any],
    progress: Callable[[str], None] = _say,
    stage: Callable[[str], None] | None = None,
) -> None:
    name, path = pick_model(args, manager, remembered, stage)
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
            check_load(manager, name, loader_name, options)  # names a bad flag plainly
            manager.load(name, loader_name, progress=progress, **options)
        else:
            assert path is not None
            _say(f"loading {path} ...")
            manager.adopt(loader.load(path, loader_name, **options), Path(path).name)
    except Exception as e:  # the UI still starts, and shows the list to choose from
        _say(f"could not load {name or path}: {e}")
        if progress is not _say:  # a background preparation shows it in the page
            raise
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
