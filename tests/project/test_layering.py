"""The layers of docs/ARCHITECTURE.md import one way: ui/extensions -> serving -> loader ->
engine -> kernels. Every import counts, inside functions and under TYPE_CHECKING too:
front ends (ui.py, webui/, extensions/) reach models only through serving/ and loader/,
the two front ends do not import each other, and nothing below the web UI imports gradio.
Inside the engine, modules import each other without cycles, and the scheduler (the books
of a step) reaches no model code, not even through another module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    # The console scripts' launcher (kestrel/commands.py) names the front ends' modules and
    # imports them when called; it holds no code of its own to import the layers for.
    "kestrel": {"engine", "kernels", "loader", "serving", "webui", "extensions", "ui", "tools"},
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


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph(layers: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (every import, as `_imports` sees them).
    `from package import module` counts as importing that module; Python runs the
    package's __init__ first, but a cycle through it alone is harmless."""
    paths = {_module_name(p): p for layer in layers for p in sorted((ROOT / layer).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                submodules = [f"{node.module}.{alias.name}" for alias in node.names]
                if all(m in paths for m in submodules):
                    found |= set(submodules)
                else:
                    found.add(node.module)
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _files() -> list[Path]:
    files = [ROOT / "ui.py"]
    for layer in ("kernels", "engine", "loader", "serving", "webui", "extensions", "kestrel"):
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


def test_no_import_cycles_in_the_engine_or_below() -> None:
    cycles = _cycles(_module_graph(("kernels", "engine", "loader")))
    assert not cycles, "modules that import each other in a cycle:\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_cycle_check_sees_a_type_checking_cycle(tmp_path: Path) -> None:
    graph = {"engine.a": {"engine.b"}, "engine.b": {"engine.a"}, "engine.c": {"engine.a"}}
    assert _cycles(graph) == [["engine.a", "engine.b"]]
    (tmp_path / "m.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.engine import E"
    )
    assert any(module == "engine.engine" for _, module in _imports(tmp_path / "m.py"))


# What the scheduler must not reach: the model (its modules, architectures, weights,
# placement, graphs, LoRA layers), the runner that owns it, the K/V storage, the kernels.
MODEL_CODE = (
    "kernels",
    "engine.architectures",
    "engine.cache",
    "engine.cuda_graph",
    "engine.draft_model",
    "engine.engine",
    "engine.fusion",
    "engine.loading",
    "engine.lora",
    "engine.modules",
    "engine.moe",
    "engine.placement",
    "engine.quant",
    "engine.quantized_linear",
    "engine.runner",
    "engine.tensor_parallel",
    "engine.weights",
)


def test_the_scheduler_reaches_no_model_code() -> None:
    graph = _module_graph(("kernels", "engine"))
    reached: set[str] = set()
    todo = ["engine.scheduler"]
    while todo:
        for module in graph[todo.pop()]:
            if module not in reached:
                reached.add(module)
                todo.append(module)
    model = sorted(m for m in reached if any(m == c or m.startswith(c + ".") for c in MODEL_CODE))
    assert not model, f"engine.scheduler imports model code (directly or not): {model}"
    assert "engine.step" in reached  # the scan follows its imports
