"""TGW-style extensions: `extensions/<name>/script.py` modules and the hooks that call them.

The contract is text-generation-webui's (modules/extensions.py there), so a simple TGW
extension runs unchanged. A script may define any of:

    params: dict                       # "name-param" keys of serving.shared.settings override it
    setup()                            # called once, after params are applied
    ui()                               # gradio components; called by the UI inside its Blocks
    input_modifier(text, state, is_chat=False) -> str     # or (text) / (text, state)
    output_modifier(text, state, is_chat=False) -> str    # applied to the finished reply
    bot_prefix_modifier(text, state) -> str               # chat: appended after the template
    state_modifier(state) -> dict
    history_modifier(history) -> history
    custom_generate_reply(question, original_question, state, stopping_strings, is_chat=False)
        -> Iterator[str] (cumulative text); only the first extension's is used
    custom_css() -> str; custom_js() -> str

Hooks run in the order the names were given to `load_extensions` (TGW: `--extensions`).
A missing or broken extension is reported with its name and skipped (or raised with
`strict=True`); it never takes the process down.

TGW's own example extensions import `modules.shared`, `modules.chat` and
`modules.text_generation`; when no `modules` package is importable, serving/tgw_compat is put
on sys.path to provide those names (see that package).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from serving import shared

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_EXTENSIONS_DIR = REPO_ROOT / "extensions"
_COMPAT_DIR = Path(__file__).resolve().parent / "tgw_compat"


class ExtensionError(RuntimeError):
    """An extension could not be found, imported or set up; the message names it."""


@dataclass
class Extension:
    name: str
    module: ModuleType
    path: Path  # its script.py

    def has(self, hook: str) -> bool:
        return callable(getattr(self.module, hook, None))

    @property
    def params(self) -> dict[str, Any]:
        params = getattr(self.module, "params", None)
        return params if isinstance(params, dict) else {}


# The loaded extensions in hook order; replaced as a whole by each load_extensions call.
_active: list[Extension] = []
_setup_done: set[str] = set()  # module names whose setup() ran (TGW calls it once)
_lock = threading.Lock()


def active() -> list[Extension]:
    return list(_active)


def load_extensions(
    names: list[str], extensions_dir: Path | None = None, *, strict: bool = False
) -> list[Extension]:
    """Import `extensions_dir/<name>/script.py` for each name, apply settings overrides to its
    `params`, call its `setup()`, and make the loaded ones the active extensions (in order).

    A name is one directory entry (a Python identifier), never a path. Failures are logged
    with the extension's name and skipped; `strict=True` raises `ExtensionError` instead."""
    directory = Path(extensions_dir) if extensions_dir is not None else DEFAULT_EXTENSIONS_DIR
    loaded: list[Extension] = []
    with _lock:
        for name in names:
            if any(e.name == name for e in loaded):
                continue
            try:
                loaded.append(_load_one(name, directory))
            except ExtensionError as error:
                if strict:
                    raise
                log.error("%s", error)
        _active[:] = loaded
    return list(loaded)


def _load_one(name: str, directory: Path) -> Extension:
    if not isinstance(name, str) or not name.isidentifier():
        raise ExtensionError(
            f"invalid extension name {name!r}: a name is one directory of {directory} "
            "(a Python identifier), not a path"
        )
    script = directory / name / "script.py"
    if not script.is_file():
        raise ExtensionError(f"extension {name!r} not found: no {script}")
    _ensure_tgw_modules()
    try:
        module = _import_script(name, directory, script)
    except Exception as error:  # an extension's import may raise anything
        hint = ""
        requirements = script.parent / "requirements.txt"
        if isinstance(error, ModuleNotFoundError) and requirements.is_file():
            hint = f"; install its requirements: pip install -r {requirements}"
        raise ExtensionError(
            f"extension {name!r} failed to import ({script}): {type(error).__name__}: {error}{hint}"
        ) from error
    extension = Extension(name, module, script)
    _apply_settings(extension)
    if module.__name__ not in _setup_done:
        if extension.has("setup"):
            try:
                module.setup()
            except Exception as error:
                raise ExtensionError(
                    f"extension {name!r}: setup() failed: {type(error).__name__}: {error}"
                ) from error
        _setup_done.add(module.__name__)
    return extension


def _import_script(name: str, directory: Path, script: Path) -> ModuleType:
    if directory.resolve() == DEFAULT_EXTENSIONS_DIR.resolve():
        # The repository's own package: `extensions.<name>.script`, as TGW imports them, so
        # their absolute imports (`from extensions.openai import ...`) work.
        return importlib.import_module(f"extensions.{name}.script")
    # Another directory: a private package per extension, so relative imports work and
    # two directories with the same extension name do not collide.
    package = f"_kestrel_ext_{abs(hash(str(directory.resolve())))}_{name}"
    module_name = f"{package}.script"
    if module_name in sys.modules:
        return sys.modules[module_name]
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            package, script.parent / "__init__.py", submodule_search_locations=[str(script.parent)]
        )
        assert spec is not None
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[package] = pkg
        if (script.parent / "__init__.py").is_file() and spec.loader is not None:
            spec.loader.exec_module(pkg)
    spec = importlib.util.spec_from_file_location(module_name, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _ensure_tgw_modules() -> None:
    """Make `import modules.shared` (TGW's package) work for TGW extensions, unless the
    process already has a `modules` package of its own (e.g. inside TGW itself)."""
    if "modules" in sys.modules or importlib.util.find_spec("modules") is not None:
        return
    sys.path.append(str(_COMPAT_DIR))


def _apply_settings(extension: Extension) -> None:
    """TGW: settings key "<extension>-<param>" overrides params[param]."""
    params = getattr(extension.module, "params", None)
    if not isinstance(params, dict):
        return
    for param in list(params):
        key = f"{extension.name}-{param}"
        if key in shared.settings:
            params[param] = shared.settings[key]


# -- hooks ---------------------------------------------------------------------------------
def _call_string_hook(
    func: Callable[..., Any], text: str, state: dict[str, Any], is_chat: bool
) -> Any:
    # TGW passes `state` only to functions with two positional parameters, and `is_chat`
    # only to those that declare it, so old one-argument extensions keep working.
    parameters = inspect.signature(func).parameters
    takes_chat = "is_chat" in parameters
    positional = len([p for p in parameters if p != "is_chat"])
    args: list[Any] = [text, state] if positional == 2 else [text]
    kwargs = {"is_chat": is_chat} if takes_chat else {}
    return func(*args, **kwargs)


def _apply_string(hook: str, text: str, state: dict[str, Any], is_chat: bool) -> str:
    for extension in active():
        if extension.has(hook):
            text = _call_string_hook(getattr(extension.module, hook), text, state, is_chat)
    return text


def apply_input_modifier(text: str, state: dict[str, Any], is_chat: bool = False) -> str:
    return _apply_string("input_modifier", text, state, is_chat)


def apply_output_modifier(text: str, state: dict[str, Any], is_chat: bool = False) -> str:
    return _apply_string("output_modifier", text, state, is_chat)


def apply_bot_prefix_modifier(prefix: str, state: dict[str, Any]) -> str:
    return _apply_string("bot_prefix_modifier", prefix, state, False)


def apply_state_modifier(state: dict[str, Any]) -> dict[str, Any]:
    for extension in active():
        if extension.has("state_modifier"):
            state = extension.module.state_modifier(state)
    return state


def apply_history_modifier(history: Any) -> Any:
    for extension in active():
        if extension.has("history_modifier"):
            history = extension.module.history_modifier(history)
    return history


def custom_generate_reply() -> Callable[..., Iterator[str]] | None:
    """The first active extension's `custom_generate_reply`, or None (TGW uses only one)."""
    for extension in active():
        if extension.has("custom_generate_reply"):
            generate: Callable[..., Iterator[str]] = extension.module.custom_generate_reply
            return generate
    return None


def custom_css() -> str:
    return "".join(e.module.custom_css() for e in active() if e.has("custom_css"))


def custom_js() -> str:
    return "".join(e.module.custom_js() for e in active() if e.has("custom_js"))
