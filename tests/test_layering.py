"""The layers of docs/ARCHITECTURE.md import one way: ui/extensions -> serving -> loader ->
engine -> kernels. Every import counts, inside functions and under TYPE_CHECKING too: front
ends (ui.py, webui/, extensions/) reach models only through serving/ and loader/, the two
front ends do not import each other, and nothing below the web UI imports gradio."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FRONT_ENDS = ("webui", "extensions", "ui")
BELOW_SERVING = {"serving", "webui", "extensions", "ui", "gradio", "tools"}
# What each layer must not import (top-level package names).
FORBIDDEN: dict[str, set[str]] = {
    "kernels": {"engine", "loader"} | BELOW_SERVING,
    "engine": {"loader"} | BELOW_SERVING,
    "loader": BELOW_SERVING,
    "serving": {"engine", "kernels", "webui", "extensions", "ui", "gradio", "tools"},
    # The API (extensions/openai) runs beside the UI or alone: the two share serving/ only.
    "webui": {"engine", "kernels", "extensions", "tools"},
    "extensions": {"engine", "kernels", "webui", "ui", "tools"},
    "ui": {"engine", "kernels", "tools"},
}


# Deliberate exceptions, each with its reason.
ALLOWED = {
    # The TGW adapter runs inside text-generation-webui's process, whose web UI is Gradio:
    # it raises gr.Error there so that TGW shows the message (only if gradio is loaded).
    ("loader/tgw/glue.py", "gradio"),
    # ui.py --api starts the API extension beside the UI, in the same process (as TGW's --api
    # loads extensions/openai); the API never imports the UI.
    ("webui/api_server.py", "extensions"),
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
    for layer in ("kernels", "engine", "loader", "serving", "webui", "extensions"):
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
