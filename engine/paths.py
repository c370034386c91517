"""Confining names read from requests or files to one directory.

`confined_path(root, name, what=...)` is the one check every name that comes from outside
(a model or LoRA name from the UI or the API, a shard file named by a checkpoint's index
JSON) goes through before it is joined to a directory: the name must be a relative path
that stays inside `root` after symlinks are resolved. Anything else raises
`PathConfinementError` (a ValueError) naming the name, what it was for and the directory.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath


class PathConfinementError(ValueError):
    """A name would reach outside the directory it must stay in."""


def hub_snapshot_repo(model_dir: str | Path) -> Path | None:
    """The repository folder of a Hugging Face cache snapshot
    (`<cache>/models--org--name/snapshots/<revision>`), whose files are symlinks into the
    repository's own `blobs/`; None for any other folder."""
    snapshot = Path(model_dir)
    repo = snapshot.parent.parent
    if snapshot.parent.name == "snapshots" and repo.name.startswith("models--"):
        return repo if (repo / "blobs").is_dir() else None
    return None


def confined_path(
    root: str | Path,
    name: object,
    *,
    what: str = "file",
    single_component: bool = False,
    within: str | Path | None = None,
) -> Path:
    """`root / name`, checked to stay inside `root` (symlinks resolved), or inside
    `within` where given (a folder holding `root`, e.g. `hub_snapshot_repo(root)`).

    `single_component=True` accepts only one entry of `root` (a model or LoRA name), never
    a path with separators. Existence is not checked: callers say "not found" their way."""
    if not isinstance(name, str) or not name or "\x00" in name or name in {".", ".."}:
        raise PathConfinementError(f"invalid {what} name {name!r}")
    # Both spellings of absolute paths and drive letters, whatever this OS is: a name
    # written on Windows reaches a Linux server through the API too.
    absolute = PurePosixPath(name).is_absolute() or PureWindowsPath(name).anchor != ""
    if absolute:
        raise PathConfinementError(
            f"invalid {what} name {name!r}: an absolute path; it must lie inside {root}"
        )
    if single_component and ("/" in name or "\\" in name):
        raise PathConfinementError(
            f"invalid {what} name {name!r}: a name is one entry of {root}, not a path"
        )
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        raise PathConfinementError(f"invalid {what} name {name!r}: '..' leaves {root}")
    base = Path(root)
    candidate = base / name
    fence = Path(within) if within is not None else base
    resolved_root = fence.resolve()
    resolved = candidate.resolve()
    if resolved_root not in resolved.parents:
        raise PathConfinementError(
            f"{what} {name!r} points outside {fence} (it resolves to {resolved})"
        )
    return candidate
