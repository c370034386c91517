"""The layers of docs/ARCHITECTURE.md import one way: ui/extensions -> loader -> engine ->
kernels. Every import counts, inside functions and under TYPE_CHECKING too: front ends
(ui.py, webui/, extensions/) reach models only through loader/, and nothing below the web
UI imports gradio."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FRONT_ENDS = ("webui", "extensions", "ui")
# What each layer must not import (top-level package names).
FORBIDDEN: dict[str, set[str]] = {
    "kernels": {"engine", "loader", "webui", "extensions", "ui", "gradio", "tools"},
    "engine": {"loader", "webui", "extensions", "ui", "gradio", "tools"},
    "loader": {"webui", "extensions", "ui", "gradio", "tools"},
    "webui": {"engine", "kernels", "tools"},
    "extensions": {"engine", "kernels", "tools"},
    "ui": {"engine", "kernels", "tools"},
}


# Deliberate exceptions, each with its reason.
ALLOWED = {
    # The TGW adapter runs inside text-generation-webui's process, whose web UI is Gradio:
    # it raises gr.Error there so that TGW shows the message (only if gradio is loaded).
    ("loader/tgw/glue.py", "gradio"),
}


def _layer(path: Path) -> str:
    relative = path.relative_to(ROOT)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _files() -> list[Path]:
    files = [ROOT / "ui.py"]
    for layer in ("kernels", "engine", "loader", "webui", "extensions"):
        files += sorted((ROOT / layer).rglob("*.py"))
    return files


def test_every_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for path in _files():
        forbidden = FORBIDDEN[_layer(path)]
        for line, module in _imports(path):
            top = module.split(".")[0]
            if top in forbidden and (str(path.relative_to(ROOT)), top) not in ALLOWED:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


@pytest.mark.parametrize("snippet", ["import engine.cache", "from engine import cache",
                                     "def f():\n    from engine.cache import X"])  # fmt: skip
def test_the_scan_sees_every_kind_of_import(tmp_path: Path, snippet: str) -> None:
    file = tmp_path / "m.py"
    file.write_text(snippet)
    assert any(module.startswith("engine") for _, module in _imports(file))
