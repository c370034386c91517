"""Kestrel in text-generation-webui's (TGW) environment: the README's install command keeps
every package TGW pins, the installer runs without the engine, and TGW's names map.

TGW's pins per release are recorded in tests/data/tgw_pins.json (read from TGW's
requirements files and one_click.py for every release the installer accepts). The
resolver test asks pip what the README's `pip install` would install into an environment
holding those pins (`--dry-run --report`: metadata only, nothing is installed); it needs
the package index and is skipped, saying so, when pip cannot reach it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from helpers.checkout import clean_env, layered_venv
from loader.base import LoaderError
from loader.tgw.edits import EDITS
from loader.tgw.installer import shim_source
from loader.tgw.names import CACHE_TYPES, kestrel_cache_type
from loader.tgw.state import load_options

ROOT = Path(__file__).resolve().parents[2]
PINS = json.loads((ROOT / "tests/data/tgw_pins.json").read_text())["releases"]
# TGW's environment: Linux x86-64 with TGW's Python (3.11 in its installer).
TGW_ENV = {
    **default_environment(),
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "python_version": "3.11",
}


def readme_tgw_commands() -> list[str]:
    """The shell commands of the README's text-generation-webui section, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## text-generation-webui\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                commands.append(command)
    return commands


def engine_requirements() -> list[Requirement]:
    lines = (ROOT / "requirements-engine.txt").read_text().splitlines()
    return [Requirement(line.split("#", 1)[0]) for line in lines if line.split("#", 1)[0].strip()]


def pin_example(spec: str) -> Version:
    """A version TGW's pin `spec` allows: the pinned one, x.y.0 for `==x.y.*`."""
    match = re.fullmatch(r"==\s*([0-9][^*]*?)(\.\*)?", spec.strip())
    assert match, f"not an == pin: {spec}"
    return Version(match.group(1) + (".0" if match.group(2) else ""))


# -- what the README installs ----------------------------------------------------------------
def test_readme_installs_the_engine_package_only():
    commands = readme_tgw_commands()
    pip = [c for c in commands if c.startswith("pip install ")]
    assert pip == ["pip install /path/to/kestrel"], commands
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dynamic = project["tool"]["setuptools"]["dynamic"]
    assert dynamic["dependencies"] == {"file": ["requirements-engine.txt"]}
    assert set(dynamic["optional-dependencies"]) == {"ui", "api", "dev"}
    # The console script the README runs is the installer's CLI.
    scripts = project["project"]["scripts"]
    used = {c.split()[0] for c in commands if not c.startswith("pip ")}
    assert used == {"kestrel-tgw"} and scripts["kestrel-tgw"] == "loader.tgw.__main__:main"
    # setup.sh still installs everything (requirements.txt = engine + UI + API).
    included = re.findall(r"^-r (\S+)", (ROOT / "requirements.txt").read_text(), re.M)
    assert included == ["requirements-engine.txt", "requirements-ui.txt", "requirements-api.txt"]


@pytest.mark.parametrize("release", sorted(PINS))
def test_engine_ranges_admit_every_tgw_pin(release):
    pins = PINS[release]
    clashes = []
    for req in engine_requirements():
        if req.marker is not None and not req.marker.evaluate(TGW_ENV):
            continue
        spec = pins.get(req.name) or pins.get(canonicalize_name(req.name))
        if spec is not None and pin_example(spec) not in req.specifier:
            clashes.append(f"{req} vs TGW's {req.name}{spec}")
    assert not clashes, f"TGW {release}: " + "; ".join(clashes)
    # torch's own triton: TGW's torch 2.9 pins triton 3.5, which the engine's range admits.
    triton = next(r for r in engine_requirements() if r.name == "triton")
    assert Version("3.5.1") in triton.specifier and Version("3.9.0") not in triton.specifier
    assert (
        pin_example(pins["torch"])
        in next(r for r in engine_requirements() if r.name == "torch").specifier
    )


# -- pip's resolver: TGW's pins plus the README's command ------------------------------------
def _tgw_tree(tmp_path: Path, release: str) -> Path:
    """A TGW folder: the checkout named by KESTREL_TGW_PATH when given (its own code), else
    a bare one; either way with `release`'s pins as its requirements file."""
    root = tmp_path / "text-generation-webui"
    source = os.environ.get("KESTREL_TGW_PATH")
    if source:
        shutil.copytree(source, root, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    else:
        (root / "modules").mkdir(parents=True)
        (root / "server.py").write_text("")
    pins = root / "requirements" / "kestrel-check" / "pins.txt"
    pins.parent.mkdir(parents=True, exist_ok=True)
    pins.write_text("".join(f"{name}{spec}\n" for name, spec in PINS[release].items()))
    return root


def _pip_check(report: dict) -> list[str]:
    """What `pip check` would say about the set of packages in a pip report."""
    installed = {
        canonicalize_name(item["metadata"]["name"]): Version(item["metadata"]["version"])
        for item in report["install"]
    }
    problems = []
    for item in report["install"]:
        name = item["metadata"]["name"]
        for line in item["metadata"].get("requires_dist", []):
            req = Requirement(line)
            env = {**report["environment"], "extra": ""}
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            have = installed.get(canonicalize_name(req.name))
            if have is None:
                problems.append(f"{name} requires {req.name}, which is not installed")
            elif not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} requires {req}, but {req.name} {have} is installed")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("release", ["v4.7.3"])  # ~1 min of pip; every release: above
def test_readme_pip_install_keeps_tgw_pins(tmp_path, release):
    tgw = _tgw_tree(tmp_path, release)
    (pip_command,) = [c for c in readme_tgw_commands() if c.startswith("pip install ")]
    args = pip_command.split()[2:]
    args = [str(ROOT) if a == "/path/to/kestrel" else a for a in args]
    report_path = tmp_path / "report.json"
    # pip builds a local project in place; leave the checkout as the test found it.
    litter = [ROOT / "build", ROOT / "kestrel.egg-info"]
    existed = {path: path.exists() for path in litter}
    # In TGW's folder, as the README says; --dry-run --report: what pip would install into
    # an environment holding TGW's pins (--ignore-installed: not this test's own).
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q"]
            + ["--report", str(report_path), "-r", "requirements/kestrel-check/pins.txt", *args],
            cwd=tgw,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        )
    finally:
        for path, was_there in existed.items():
            if not was_there:
                shutil.rmtree(path, ignore_errors=True)
    if run.returncode != 0:
        if "ResolutionImpossible" in run.stderr or "conflict" in run.stderr.lower():
            pytest.fail(f"Kestrel's requirements conflict with TGW {release}'s:\n{run.stderr}")
        pytest.skip(f"pip could not resolve from the package index: {run.stderr[-600:]}")
    report = json.loads(report_path.read_text())
    chosen = {
        canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
        for i in report["install"]
    }
    assert chosen.get("kestrel"), "the README's command did not install Kestrel"
    changed = {
        name: (spec, chosen.get(canonicalize_name(name)))
        for name, spec in PINS[release].items()
        if not SpecifierSet(spec).contains(chosen.get(canonicalize_name(name), "0"), True)
    }
    assert not changed, f"TGW {release}'s pins changed: {changed}"
    assert chosen["torch"] == PINS[release]["torch"].lstrip("=")
    assert chosen["triton"].startswith("3.5.")  # torch 2.9's own, kept
    assert _pip_check(report) == []


# -- the installer runs without the engine, from any folder ----------------------------------
def test_installer_runs_without_torch_from_any_folder(tmp_path):
    """`python /path/to/kestrel/loader/tgw ...` from another folder, with torch and triton
    made unimportable: the installer only edits text, so it still runs (and refuses a
    folder that is not TGW, naming it)."""
    not_tgw = tmp_path / "not-tgw"
    not_tgw.mkdir()
    code = (
        "import runpy, sys\n"
        "for name in ('torch', 'triton', 'numpy'):\n"
        "    sys.modules[name] = None  # any import of them fails\n"
        f"sys.argv = ['kestrel-tgw', 'status', {str(not_tgw)!r}]\n"
        "try:\n"
        f"    runpy.run_path({str(ROOT / 'loader' / 'tgw')!r}, run_name='__main__')\n"
        "finally:\n"
        "    loaded = [m for m in sys.modules if m.split('.')[0] in ('engine', 'kernels')]\n"
        "    print('engine modules:', loaded)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert run.returncode == 1, run.stderr
    assert "does not look like a text-generation-webui folder" in run.stderr
    assert str(not_tgw) in run.stderr
    assert "engine modules: []" in run.stdout


# -- TGW's cache-type names ------------------------------------------------------------------
def test_cache_types_match_the_engine_and_map_tgw_names():
    from kernels.kv_quant import CACHE_TYPES as ENGINE_CACHE_TYPES

    assert CACHE_TYPES == tuple(ENGINE_CACHE_TYPES)
    assert [kestrel_cache_type(v) for v in ("q8_0", "q4_0", "Q8", "", None, "q6_q6")] == [
        "q8",
        "q4",
        "q8",
        "fp16",
        "fp16",
        "q6",
    ]
    assert load_options({"cache_type": "q8_0"})["cache_type"] == "q8"
    for bad in ("q5", "q4_q8", "q2"):
        with pytest.raises(LoaderError, match=rf"cache_type '{bad}': Kestrel's KV cache can "):
            load_options({"cache_type": bad})
    # The Model tab offers exactly Kestrel's list while the Kestrel loader is picked.
    (edit,) = [e for e in EDITS if e.name == "cache-types"]
    assert f"        kestrel_cache_types = {list(CACHE_TYPES)!r}" in edit.lines


# -- the generated modules/kestrel.py when Kestrel moves -------------------------------------
def test_shim_says_when_kestrel_moved(tmp_path):
    kestrel = tmp_path / "kestrel"
    for package in ("kernels", "engine", "loader"):
        shutil.copytree(ROOT / package, kestrel / package, ignore=shutil.ignore_patterns("__py*"))
    tgw = tmp_path / "tgw"
    (tgw / "modules").mkdir(parents=True)
    (tgw / "modules" / "__init__.py").write_text("")
    (tgw / "modules" / "kestrel.py").write_text(shim_source(kestrel))
    code = "import modules.kestrel as k; print(k._glue.__file__, k.load_model.__module__)"
    # TGW's Python sees this environment's packages but not this checkout: setup.sh installs
    # the checkout into .venv (editable), whose `loader` would rightly be refused as shadowing.
    python = layered_venv(tmp_path / "tgw-venv")

    def import_shim() -> subprocess.CompletedProcess:
        return subprocess.run(
            [python, "-c", code], cwd=tgw, capture_output=True, text=True, env=clean_env()
        )

    run = import_shim()
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(kestrel / "loader/tgw/glue.py"), "loader.tgw.glue"]

    kestrel.rename(tmp_path / "kestrel-moved")
    run = import_shim()
    assert run.returncode == 1
    assert f"installed into this text-generation-webui from {kestrel}" in run.stderr
    assert "Kestrel is no longer there" in run.stderr
    assert f"kestrel-tgw install {tgw}" in run.stderr
