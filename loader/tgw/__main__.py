"""kestrel-tgw {install,uninstall,status,hashes} PATH_TO_TGW [--dry-run]

The same as `python -m loader.tgw ...`. `kestrel-tgw` is the console script `pip install
/path/to/kestrel` puts into the environment; `python /path/to/kestrel/loader/tgw ...`
works from any folder without installing. Either way only text files are edited: nothing
here imports the engine (torch, triton).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run by path: the `loader` package is two folders up from here
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loader.tgw import installer  # noqa: E402
from loader.tgw.edits import EDITS, SHIM_FILE  # noqa: E402
from loader.tgw.names import LOADER_NAME  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kestrel-tgw",
        description="Add the Kestrel loader to text-generation-webui, or remove it.",
    )
    parser.add_argument("command", choices=["install", "uninstall", "status", "hashes"])
    parser.add_argument("tgw", type=Path, help="the text-generation-webui folder")
    parser.add_argument(
        "--dry-run", action="store_true", help="show the changes as a diff; write nothing"
    )
    args = parser.parse_args(argv)
    root = args.tgw.expanduser().resolve()
    try:
        if args.command == "status":
            return _status(root)
        if args.command == "hashes":
            for (file, unit), digest in installer.unit_hashes(root).items():
                print(f"{file}:{unit}  {digest}")
            return 0
        plan = (installer.plan_install if args.command == "install" else installer.plan_uninstall)(
            root
        )
    except installer.InstallError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if plan.versions:
        print(f"text-generation-webui at {root}: matches {', '.join(plan.versions)}")
    if not plan.pending:
        print(f"nothing to do: Kestrel is already {args.command}ed there")
        return 0
    if args.dry_run:
        for change in plan.pending:
            sys.stdout.write(change.diff(root))
        print(f"(dry run: {len(plan.pending)} file(s) would change; nothing was written)")
        return 0
    for path in installer.apply(plan):
        print(f"{args.command}: {path.relative_to(root)}")
    if args.command == "install":
        print(
            f"done: start text-generation-webui and pick the '{LOADER_NAME}' loader "
            f"(or --loader kestrel). Undo with: kestrel-tgw uninstall {root}"
        )
    return 0


def _status(root: Path) -> int:
    versions = installer.recognise(root)
    print(f"text-generation-webui at {root}: matches {', '.join(versions)}")
    files = sorted({edit.file for edit in EDITS})
    marked = [f for f in files if installer.BEGIN in (root / f).read_text(encoding="utf-8")]
    installed = (root / SHIM_FILE).exists()
    if installed and installer.plan_install(root).pending == []:
        print("Kestrel loader: installed and up to date")
    elif installed or marked:
        print("Kestrel loader: installed, but not as this Kestrel would (run install again)")
    else:
        print("Kestrel loader: not installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
