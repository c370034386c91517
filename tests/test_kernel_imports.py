"""Kernel modules share code only through public names: no module under kernels/ imports an
underscore name from another kernels module, nor reads one off an imported kernels module
(`import kernels.x as m; m._helper`). A helper that several kernels use lives in a shared
module under a public name (issue 27, item 4). A static check of the source (AST), so it
sees imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(KERNELS.rglob("*.py"))}


def _absolute(module_name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    package = module_name.split(".") if is_package else module_name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(name: str, source: str, *, is_package: bool = False) -> list[str]:
    """`line: what` for each underscore name the kernels module `name` (its source text)
    takes from another kernels module."""
    tree = ast.parse(source)
    found: list[str] = []
    module_aliases: set[str] = set()  # local names bound to kernels modules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES and alias.asname:
                    module_aliases.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            origin = _absolute(name, is_package, node)
            if origin not in MODULES or origin == name:
                continue
            for alias in node.names:
                if f"{origin}.{alias.name}" in MODULES:
                    module_aliases.add(alias.asname or alias.name)
                elif _private(alias.name):
                    found.append(f"{node.lineno}: from {origin} import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in module_aliases
            and _private(node.attr)
        ):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_kernel_modules_import_no_private_names() -> None:
    assert "kernels.backend" in MODULES, f"no kernel modules found under {KERNELS}"
    offences = {
        str(path.relative_to(ROOT)): hits
        for name, path in MODULES.items()
        if (
            hits := private_imports(
                name, path.read_text(encoding="utf-8"), is_package=path.name == "__init__.py"
            )
        )
    }
    assert not offences, "underscore names imported between kernel modules:\n" + "\n".join(
        f"  {file}: {hit}" for file, hits in offences.items() for hit in hits
    )


def test_check_sees_each_form() -> None:
    # The check itself, on a module that would sit at kernels/probe.py.
    source = (
        "from kernels.backend import _PROGRAMMATIC_LAUNCH, resolve_backend\n"
        "import kernels.backend as be\n"
        "from kernels import backend\n"
        "from .backend import _cuda_capability\n"
        "x = be._PROGRAMMATIC_LAUNCH, backend._PROGRAMMATIC_LAUNCH, be.resolve_backend\n"
        "y = backend.__name__\n_own_helper = 1\n"
    )
    hits = private_imports("kernels.probe", source)
    assert [hit.split(": ", 1)[1] for hit in hits] == [
        "from kernels.backend import _PROGRAMMATIC_LAUNCH",
        "from kernels.backend import _cuda_capability",
        "be._PROGRAMMATIC_LAUNCH",
        "backend._PROGRAMMATIC_LAUNCH",
    ]
