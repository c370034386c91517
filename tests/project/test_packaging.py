"""Kestrel as an installed package (issue 27): what `bash setup.sh` and `pip install
/path/to/kestrel` put into an environment, and text-generation-webui's (TGW) extensions beside
a Kestrel checkout.

- setup.sh's `pip install -e .` puts the checkout's root on the environment's path and the
  console scripts into its bin/: each runs from any folder, and so do the tools
  (`python tools/x.py`), which no longer edit sys.path.
- `pip install /path/to/kestrel` (TGW's route) builds a wheel of the engine's packages and the
  scripts' launcher only, nothing that could shadow TGW's own top-level names; there the front
  ends' scripts say they run from a checkout.
- Kestrel's `extensions` is a namespace package, as TGW's is: with Kestrel's root on TGW's path
  (an editable install into TGW's environment, the installer's shim pointing at a checkout)
  TGW's extensions still import from TGW's folder. A regular package of that name anywhere on
  the path would win over TGW's.

The installs go into scratch virtual environments layered over the one running the tests
(tests/helpers/checkout.py), offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers.checkout import (
    ROOT,
    clean_env,
    console_scripts,
    copy_checkout,
    layered_venv,
    pip_offline,
)

pytestmark = pytest.mark.slow
SCRIPTS = console_scripts()
ENGINE_PACKAGES = {"kernels", "engine", "loader", "kestrel"}
TGW_PATH = os.environ.get("KESTREL_TGW_PATH")


def _run(argv: list[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_checkout(tmp_path_factory.mktemp("kestrel"))


def test_the_console_scripts_name_existing_functions() -> None:
    assert {"kestrel", "kestrel-ui", "kestrel-api", "kestrel-convert", "kestrel-tgw"} <= set(
        SCRIPTS
    )
    for name, target in SCRIPTS.items():
        module, function = target.split(":")
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), name
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")
        assert f"def {function}(" in source, name


def test_editable_install_runs_every_script_and_tool_from_any_folder(
    checkout: Path, tmp_path: Path
) -> None:
    python = layered_venv(tmp_path / "venv")
    pip_offline(python, "install", "-e", str(checkout))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([python, "-c", "import ui, extensions.openai, tools.bench; print(ui.__file__)"],
                 elsewhere)  # fmt: skip
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()) == checkout / "ui.py"
    for name in SCRIPTS:
        result = _run([python.parent / name, "--help"], elsewhere)
        assert result.returncode == 0, f"{name} --help:\n{result.stderr[-2000:]}"
        # Usage names the command typed, not its `python ...` form.
        assert result.stdout.startswith(f"usage: {name} "), (name, result.stdout[:200])
    # A tool started by path: its folder is on sys.path, the checkout's root through the
    # install (tools/ no longer put it there themselves).
    tool = _run([python, checkout / "tools" / "perplexity.py", "--help"], elsewhere)
    assert tool.returncode == 0, tool.stderr[-2000:]


def test_wheel_holds_the_engine_and_its_front_end_scripts_explain(
    checkout: Path, tmp_path: Path
) -> None:
    python = layered_venv(tmp_path / "venv")
    pip_offline(python, "wheel", "-w", str(tmp_path / "wheels"), str(checkout))
    (wheel,) = (tmp_path / "wheels").glob("kestrel-*.whl")
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist()}
        (entry_points,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        scripts = z.read(entry_points).decode()
    assert {t for t in tops if not t.endswith(".dist-info")} == ENGINE_PACKAGES
    for name in SCRIPTS:
        assert f"{name} = {SCRIPTS[name]}" in scripts

    pip_offline(python, "install", str(wheel))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tgw = _run([python.parent / "kestrel-tgw", "--help"], elsewhere)
    assert tgw.returncode == 0 and "text-generation-webui" in tgw.stdout, tgw.stderr[-2000:]
    for name in ("kestrel-ui", "kestrel-api", "kestrel-convert"):
        result = _run([python.parent / name, "--help"], elsewhere)
        assert result.returncode == 2, f"{name}: {result.returncode}\n{result.stderr[-2000:]}"
        assert "runs from a Kestrel checkout" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr


def _tgw_extensions_from(tgw: Path) -> dict[str, str]:
    """Where each of TGW's extensions imports from, run as TGW runs (its folder first on the
    path) with Kestrel's root on the path after it."""
    names = sorted(p.parent.name for p in (tgw / "extensions").glob("*/script.py"))
    assert names, f"no extensions/*/script.py under {tgw}"
    code = (
        "import importlib.util, json, sys\n"
        f"names = {names!r}\n"
        "print(json.dumps({n: importlib.util.find_spec(f'extensions.{n}.script').origin "
        "for n in names}))\n"
    )
    env = {**clean_env(), "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tgw, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_kestrel_on_the_path_leaves_a_tgw_style_extensions_folder_alone(tmp_path: Path) -> None:
    # TGW's layout: a folder with server.py and extensions/<name>/script.py, no __init__.py.
    tgw = tmp_path / "webui"
    (tgw / "extensions" / "gallery").mkdir(parents=True)
    (tgw / "extensions" / "gallery" / "script.py").write_text("params = {}\n")
    (tgw / "server.py").write_text("")
    origins = _tgw_extensions_from(tgw)
    assert origins == {"gallery": str(tgw / "extensions" / "gallery" / "script.py")}


@pytest.mark.skipif(not TGW_PATH, reason="set KESTREL_TGW_PATH to a text-generation-webui checkout")
def test_kestrel_on_the_path_leaves_tgws_extensions_alone() -> None:
    tgw = Path(TGW_PATH or "").resolve()
    for name, origin in _tgw_extensions_from(tgw).items():
        assert Path(origin).is_relative_to(tgw / "extensions"), (name, origin)
