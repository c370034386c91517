"""What the source audits read: the shipped Python files and the AST helpers that name a call."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# Every package and script of the checkout (serving/ was missing from this list until issue
# 27, item 5; it passes the same audit).
SHIPPED = ["engine", "kernels", "loader", "serving", "webui", "extensions", "kestrel", "tools"]
SHIPPED += ["convert.py", "ui.py"]


def is_false(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def shipped_files() -> list[Path]:
    files: list[Path] = []
    for entry in SHIPPED:
        path = ROOT / entry
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files
