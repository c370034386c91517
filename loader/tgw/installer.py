"""Install the Kestrel loader into a text-generation-webui (TGW) tree, and remove it.

    plan = plan_install(tgw_root)      # what would change; raises InstallError if refused
    apply(plan)                        # writes it (each file atomically)
    plan_uninstall(tgw_root)           # the reverse: strips the marked blocks, drops the shim

Install recognises TGW by content: every top-level function or assignment it edits must
hash to a value recorded in loader/tgw/edits.py (KNOWN_UNITS) for a TGW release the
edits were checked against; anything else is refused with a message naming the file
and function. Marked blocks already there are taken out first, so installing twice
changes nothing and installing a newer Kestrel replaces the old blocks. Uninstall leaves
every file byte for byte as it was before install.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from loader.tgw.edits import EDITS, KNOWN_UNITS, SHIM_FILE, Edit

BEGIN = "# >>> kestrel"
END = "# <<< kestrel"
_BEGIN_NOTE = "added by `python -m loader.tgw install`, removed by `uninstall`"
SHIM_HEADER = '"""Kestrel loader for text-generation-webui (written by `python -m loader.tgw'


class InstallError(RuntimeError):
    """The TGW tree is not one this installer can edit safely; the message says why."""


@dataclass
class FileChange:
    path: Path
    old: str | None  # None: the file does not exist
    new: str | None  # None: delete the file

    @property
    def changed(self) -> bool:
        return self.old != self.new

    def diff(self, root: Path) -> str:
        name = str(self.path.relative_to(root))
        return "".join(
            difflib.unified_diff(
                (self.old or "").splitlines(keepends=True),
                (self.new or "").splitlines(keepends=True),
                f"a/{name}",
                f"b/{name}",
            )
        )


@dataclass
class Plan:
    root: Path
    changes: list[FileChange] = field(default_factory=list)
    versions: tuple[str, ...] = ()  # TGW releases whose edited code matches this tree

    @property
    def pending(self) -> list[FileChange]:
        return [c for c in self.changes if c.changed]


# -- marked blocks --------------------------------------------------------------------------
def strip_blocks(text: str, where: str) -> str:
    """`text` without Kestrel's marked blocks (whole lines from BEGIN to END)."""
    out: list[str] = []
    inside = False
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        mark = line.strip()
        if mark.startswith(BEGIN):
            if inside:
                raise InstallError(f"{where}:{number}: a Kestrel block opens inside another")
            inside = True
        elif mark.startswith(END):
            if not inside:
                raise InstallError(f"{where}:{number}: a Kestrel block ends without a start")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise InstallError(f"{where}: a Kestrel block is not closed (a '{END}' line is missing)")
    return "".join(out)


def _render(edit: Edit, newline: str) -> str:
    first = next((line for line in edit.lines if line.strip()), "")
    indent = first[: len(first) - len(first.lstrip())]
    lines = [f"{indent}{BEGIN} {edit.name}: {_BEGIN_NOTE}", *edit.lines, f"{indent}{END}"]
    return "".join(line + newline for line in lines)


# -- recognising the TGW version --------------------------------------------------------------
def _unit_spans(text: str, where: str) -> dict[str, tuple[int, int]]:
    """Character span (start of first line, end of last line) of each top-level unit."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise InstallError(f"{where} is not valid Python ({e.msg}, line {e.lineno})") from None
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    spans: dict[str, tuple[int, int]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            first = node.lineno
        else:
            continue
        assert node.end_lineno is not None
        for name in names:
            spans[name] = (starts[first - 1], starts[node.end_lineno])
    return spans


def unit_hash(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]


def unit_hashes(root: Path, edits: Iterable[Edit] = EDITS) -> dict[tuple[str, str], str]:
    """Hash of every unit the edits touch, in the tree at `root` with Kestrel's blocks out."""
    hashes: dict[tuple[str, str], str] = {}
    for file, units in _units_by_file(edits).items():
        text = strip_blocks(_read(root / file, root), file)
        spans = _unit_spans(text, file)
        for unit in units:
            if unit not in spans:
                raise InstallError(f"{file}: no top-level '{unit}' (the installer edits it)")
            start, end = spans[unit]
            hashes[(file, unit)] = unit_hash(text[start:end])
    return hashes


def recognise(root: Path) -> tuple[str, ...]:
    """The known TGW releases this tree's edited code matches; InstallError if none."""
    _check_root(root)
    hashes = unit_hashes(root)
    unknown = [key for key, h in hashes.items() if h not in KNOWN_UNITS.get(key, {})]
    if unknown:
        where = ", ".join(f"{file}:{unit}()" for file, unit in unknown)
        raise InstallError(
            f"unrecognised text-generation-webui version in {root}: {where} differ from every "
            f"release the Kestrel installer knows ({known_versions_text()}). Nothing was "
            "changed. Use a supported TGW release, or a newer Kestrel that knows this one."
        )
    versions: set[str] | None = None
    for key, h in hashes.items():
        found = set(KNOWN_UNITS[key][h])
        versions = found if versions is None else versions & found
    return tuple(sorted(versions or ()))


def known_versions_text() -> str:
    versions = sorted({v for table in KNOWN_UNITS.values() for vs in table.values() for v in vs})
    return ", ".join(versions) if versions else "none"


# -- plans -----------------------------------------------------------------------------------
def plan_install(root: Path, kestrel_root: Path | None = None) -> Plan:
    root = Path(root).resolve()
    versions = recognise(root)
    plan = Plan(root, versions=versions)
    for file, edits in _edits_by_file().items():
        path = root / file
        current = _read(path, root)
        original = strip_blocks(current, file)
        plan.changes.append(FileChange(path, current, _apply_edits(original, edits, file)))
    shim = root / SHIM_FILE
    old_shim = shim.read_text(encoding="utf-8") if shim.exists() else None
    if old_shim is not None and not old_shim.startswith(SHIM_HEADER):
        raise InstallError(f"{shim} exists and was not written by Kestrel; not overwriting it")
    plan.changes.append(FileChange(shim, old_shim, shim_source(kestrel_root or _kestrel_root())))
    return plan


def plan_uninstall(root: Path) -> Plan:
    root = Path(root).resolve()
    _check_root(root)
    plan = Plan(root)
    for file in _edits_by_file():
        path = root / file
        current = _read(path, root)
        plan.changes.append(FileChange(path, current, strip_blocks(current, file)))
    shim = root / SHIM_FILE
    if shim.exists():
        text = shim.read_text(encoding="utf-8")
        if not text.startswith(SHIM_HEADER):
            raise InstallError(f"{shim} was not written by Kestrel; not removing it")
        plan.changes.append(FileChange(shim, text, None))
    return plan


def apply(plan: Plan) -> list[Path]:
    """Write the plan's changes; returns the files changed. Each write is atomic."""
    done = []
    for change in plan.pending:
        if change.new is None:
            change.path.unlink()
        else:
            _write_atomic(change.path, change.new)
        done.append(change.path)
    return done


# -- details ---------------------------------------------------------------------------------
def _apply_edits(original: str, edits: list[Edit], file: str) -> str:
    newline = "\r\n" if "\r\n" in original else "\n"
    spans = _unit_spans(original, file)
    inserts: list[tuple[int, int, str]] = []
    for order, edit in enumerate(edits):
        if edit.unit not in spans:
            raise InstallError(f"{file}: no top-level '{edit.unit}' for edit '{edit.name}'")
        start, end = spans[edit.unit]
        if edit.anchor is None:
            at = end
        else:
            anchor = edit.anchor.replace("\n", newline)
            count = original.count(anchor, start, end)
            if count != 1:
                raise InstallError(
                    f"{file}:{edit.unit}(): the text edit '{edit.name}' anchors on occurs "
                    f"{count} times (expected once)"
                )
            found = original.index(anchor, start, end)
            at = found if edit.before else found + len(anchor)
        inserts.append((at, order, _render(edit, newline)))
    text = original
    for at, _, block in sorted(inserts, reverse=True):
        text = text[:at] + block + text[at:]
    return text


def shim_source(kestrel_root: Path) -> str:
    """modules/kestrel.py: puts the Kestrel that ran the install (the folder holding its
    `loader` package: a checkout, or site-packages after `pip install`) on sys.path and
    imports the glue from there. When that Kestrel has moved or been uninstalled, or another
    `loader` package shadows it, the import fails with a message saying what to do."""
    root = str(Path(kestrel_root).resolve())
    return (
        f"{SHIM_HEADER} install`,\n"
        "removed by `python -m loader.tgw uninstall`). The code lives in Kestrel's\n"
        'loader/tgw/glue.py; this file only makes Kestrel importable from TGW."""\n'
        "\n"
        "import os\n"
        "import sys\n"
        "\n"
        f"KESTREL_ROOT = {root!r}\n"
        "_GLUE = os.path.join(KESTREL_ROOT, 'loader', 'tgw', 'glue.py')\n"
        "_TGW = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))\n"
        "if not os.path.isfile(_GLUE):\n"
        "    raise ImportError(\n"
        "        f'the Kestrel loader was installed into this text-generation-webui from '\n"
        "        f'{KESTREL_ROOT}, and Kestrel is no longer there (moved or uninstalled). '\n"
        "        f'Install it again from where Kestrel is now: pip install /path/to/kestrel, '\n"
        "        f'then kestrel-tgw install {_TGW}'\n"
        "    )\n"
        "if KESTREL_ROOT not in sys.path:\n"
        "    sys.path.append(KESTREL_ROOT)\n"
        "\n"
        "try:\n"
        "    from loader.tgw import glue as _glue\n"
        "except ImportError as e:\n"
        "    raise ImportError(\n"
        "        f'cannot import Kestrel from {KESTREL_ROOT}: {e}. Install its engine into '\n"
        "        'this Python (from the cmd_* shell): pip install /path/to/kestrel'\n"
        "    ) from e\n"
        "if os.path.realpath(_glue.__file__) != os.path.realpath(_GLUE):\n"
        "    raise ImportError(\n"
        "        f\"another package named 'loader' ({_glue.__file__}) shadows Kestrel's at \"\n"
        "        f'{KESTREL_ROOT}; remove it from this Python or reinstall Kestrel'\n"
        "    )\n"
        "add_lora_to_model, encode, load_model = (\n"
        "    _glue.add_lora_to_model,\n"
        "    _glue.encode,\n"
        "    _glue.load_model,\n"
        ")\n"
    )


def _kestrel_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _check_root(root: Path) -> None:
    if not (root / "server.py").is_file() or not (root / "modules").is_dir():
        raise InstallError(
            f"{root} does not look like a text-generation-webui folder "
            "(no server.py and modules/ there)"
        )


def _read(path: Path, root: Path) -> str:
    if not path.is_file():
        raise InstallError(f"{path} is missing: is {root} a complete text-generation-webui tree?")
    with open(path, encoding="utf-8", newline="") as f:  # keep \r\n as it is
        return f.read()


def _write_atomic(path: Path, text: str) -> None:
    mode = path.stat().st_mode if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _edits_by_file() -> dict[str, list[Edit]]:
    by_file: dict[str, list[Edit]] = {}
    for edit in EDITS:
        by_file.setdefault(edit.file, []).append(edit)
    return by_file


def _units_by_file(edits: Iterable[Edit]) -> dict[str, list[str]]:
    by_file: dict[str, list[str]] = {}
    for edit in edits:
        units = by_file.setdefault(edit.file, [])
        if edit.unit not in units:
            units.append(edit.unit)
    return by_file
