"""No code execution from model files, checked on the source itself: an AST scan of every
shipped Python file (engine/, kernels/, loader/, webui/, extensions/, tools/, convert.py,
ui.py) fails CI on

- `torch.load(...)` without `weights_only=True` (a pickle runs code while it loads),
- `pickle` / `dill` / `marshal` / `shelve` imports, `numpy.load(..., allow_pickle=True)`,
- `trust_remote_code=` anything but False (a model's own Python files would run),
- the builtins `eval` / `exec`, and `yaml.load` / `yaml.unsafe_load` / `yaml.full_load`.

Extensions are imported by design (the user names them on the command line, as in
text-generation-webui); that is code the user chose, not code inside a model file.
"""

from __future__ import annotations

import ast

import pytest

from helpers.source_audit import ROOT, dotted, is_false, shipped_files

PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "marshal", "shelve", "cloudpickle"}


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_calls(source: str, filename: str = "<source>") -> list[str]:
    """'file:line: what' for each construct above found in `source`."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names]
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else names
            for module in modules:
                if module.split(".")[0] in PICKLE_MODULES:
                    found.append(f"{where}: imports {module}")
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        if name in {"eval", "exec"}:
            found.append(f"{where}: calls the builtin {name}()")
        if name == "torch.load" and not _is_true(keywords.get("weights_only", ast.Constant(None))):
            found.append(f"{where}: torch.load without weights_only=True")
        if name in {"yaml.load", "yaml.unsafe_load", "yaml.full_load"}:
            found.append(f"{where}: {name} (use yaml.safe_load)")
        if name in {"np.load", "numpy.load"} and _is_true(
            keywords.get("allow_pickle", ast.Constant(False))
        ):
            found.append(f"{where}: {name} with allow_pickle=True")
        if "trust_remote_code" in keywords and not is_false(keywords["trust_remote_code"]):
            found.append(f"{where}: trust_remote_code is not False")
        for k in node.keywords:  # **{"trust_remote_code": True}
            if k.arg is None and isinstance(k.value, ast.Dict):
                for key in k.value.keys:
                    if isinstance(key, ast.Constant) and key.value == "trust_remote_code":
                        found.append(f"{where}: trust_remote_code passed through **")
    return found


def test_shipped_code_never_executes_model_files():
    files = shipped_files()
    assert len(files) > 50, "the scan found too few files to be scanning the project"
    problems = [p for f in files for p in unsafe_calls(f.read_text(), str(f.relative_to(ROOT)))]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    "snippet, what",
    [
        ("import torch\ntorch.load('x.bin')", "torch.load without weights_only"),
        ("import torch\ntorch.load('x.bin', weights_only=False)", "torch.load without"),
        ("import pickle", "imports pickle"),
        ("from pickle import loads", "imports pickle"),
        ("import dill", "imports dill"),
        ("M.from_pretrained('m', trust_remote_code=True)", "trust_remote_code is not False"),
        ("M.from_pretrained('m', trust_remote_code=flag)", "trust_remote_code is not False"),
        ("M.from_pretrained('m', **{'trust_remote_code': True})", "passed through **"),
        ("eval(open('config.json').read())", "builtin eval"),
        ("exec(code)", "builtin exec"),
        ("import yaml\nyaml.load(text)", "yaml.load"),
        ("import numpy as np\nnp.load('a.npy', allow_pickle=True)", "allow_pickle=True"),
    ],
)
def test_the_scan_catches(snippet: str, what: str):
    problems = unsafe_calls(snippet)
    assert any(what in p for p in problems), problems


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch.load('x.bin', map_location='cpu', weights_only=True)",
        "model.eval()",
        "M.from_pretrained('m', trust_remote_code=False)",
        "import yaml\nyaml.safe_load(text)",
        "import numpy as np\nnp.load('a.npy')",
    ],
)
def test_the_scan_allows(snippet: str):
    assert unsafe_calls(snippet) == []
