"""Crash-safe files for the UI's user data (chats, presets, settings).

`atomic_write_text(path, text)` writes a temporary file in the same directory, flushes and
fsyncs it, then `os.replace`s it over the target: a reader (or the next start after a
crash) sees the old file or the new one, never a torn mix. Writers of the same file are
serialised by a lock held across processes (`fcntl.flock` on the file's directory, so no
lock file is left beside the data) and threads (a lock per path), so two concurrent saves
cannot interleave and the last one wins whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

_fcntl: ModuleType | None
try:
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - Windows: threads are still serialised
    _fcntl = None

_locks: dict[Path, threading.Lock] = {}
_locks_guard = threading.Lock()


class StorageError(ValueError):
    """A user-data file is missing, unreadable or not what it should be; says which."""


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the write lock of `path`'s folder (threads of this process and other processes).

    Across processes the lock is the folder's own flock: it leaves no `.lock` file beside
    every chat and preset, and saves are short, so one lock per folder costs nothing. Not
    re-entrant: inside it, write with `write_held`."""
    directory = Path(path).absolute().parent
    with _locks_guard:
        lock = _locks.setdefault(directory, threading.Lock())
    with lock:
        directory.mkdir(parents=True, exist_ok=True)
        if _fcntl is None:
            yield
            return
        fd = os.open(directory, os.O_RDONLY)
        try:
            _fcntl.flock(fd, _fcntl.LOCK_EX)
            try:
                yield
            finally:
                _fcntl.flock(fd, _fcntl.LOCK_UN)
        finally:
            os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically; a failure (disk full, permissions) is a
    StorageError naming the file, and the previous file stays as it was."""
    with locked(path):
        write_held(path, text)


def write_held(path: Path, text: str) -> None:
    """`atomic_write_text` for a caller already holding `locked(path)` (a read-compare-write
    such as a chat's revision check)."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise StorageError(f"could not write {path}: {e.strerror or e}") from e
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # The rename itself is durable only once the directory entry is on disk.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, ensure_ascii=False, indent=2) + "\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StorageError(f"{path} does not exist") from None
    except (OSError, ValueError) as e:
        raise StorageError(f"{path} is not readable JSON: {e}") from e


def write_yaml(path: Path, data: Any) -> None:
    atomic_write_text(path, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StorageError(f"{path} does not exist") from None
    except (OSError, yaml.YAMLError) as e:
        raise StorageError(f"{path} is not readable YAML: {e}") from e


# File names are limited to 255 bytes; the temporary file of a save adds a dot, a random
# part and ".tmp" to the name, and the extension comes on top.
MAX_NAME_BYTES = 200
NAME_PUNCTUATION = " -_.()"
NAME_PUNCTUATION_TEXT = "- _ . ( and )"


def safe_name(name: str, what: str, *, new: bool = False) -> str:
    """`name` if it can be a file name of its own (no path parts, not hidden, short enough
    in UTF-8 bytes), else an error naming it: names come from the browser and must never
    reach outside their folder. A `new` name (one about to be written) must also keep to
    the characters the error message promises; existing files with other names still open."""
    cleaned = name.strip() if isinstance(name, str) else ""
    if (
        not cleaned
        or cleaned.startswith(".")
        or any(c in cleaned for c in "/\\\x00")
        or len(cleaned.encode("utf-8")) > MAX_NAME_BYTES
        or (new and not all(c.isalnum() or c in NAME_PUNCTUATION for c in cleaned))
    ):
        raise StorageError(
            f"invalid {what} name {name!r}: use letters, digits, spaces, {NAME_PUNCTUATION_TEXT}"
            f" (not starting with a dot, at most {MAX_NAME_BYTES} bytes in UTF-8)"
        )
    return cleaned
