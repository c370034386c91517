"""Crash-safe files for the UI's user data (chats, presets, settings).

`atomic_write_text(path, text)` writes a temporary file in the same directory, flushes and
fsyncs it, then `os.replace`s it over the target: a reader (or the next start after a
crash) sees the old file or the new one, never a torn mix. Writers of the same file are
serialised by a per-path lock held across processes (`fcntl.flock` on `<name>.lock`) and
threads (a lock per path), so two concurrent saves cannot interleave and the last one wins
whole; the lock file exists only while a write holds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: threads are still serialised
    fcntl = None  # type: ignore[assignment]

_locks: dict[Path, threading.Lock] = {}
_locks_guard = threading.Lock()


class StorageError(ValueError):
    """A user-data file is missing, unreadable or not what it should be; says which."""


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the write lock of `path` (threads of this process and other processes)."""
    path = Path(path).absolute()
    with _locks_guard:
        lock = _locks.setdefault(path, threading.Lock())
    with lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock_file = path.with_name(path.name + ".lock")
        while True:
            handle = open(lock_file, "a+b")  # noqa: SIM115 - closed below, after the unlink
            if fcntl is None:
                break
            fcntl.flock(handle, fcntl.LOCK_EX)
            # The holder before us deletes the file as it leaves: a lock taken on a deleted
            # file guards nothing, so take the current one's instead.
            try:
                current = os.path.samestat(os.fstat(handle.fileno()), os.stat(lock_file))
            except FileNotFoundError:
                current = False
            if current:
                break
            handle.close()
        try:
            yield
        finally:
            # Removed while still held, so that no `.lock` file outlives its write.
            with contextlib.suppress(OSError):
                os.unlink(lock_file)
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    with locked(path):
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


def safe_name(name: str, what: str) -> str:
    """`name` if it can be a file name of its own (no path parts, not hidden), else an error
    naming it: names come from the browser and must never reach outside their folder."""
    cleaned = name.strip() if isinstance(name, str) else ""
    if (
        not cleaned
        or cleaned.startswith(".")
        or any(c in cleaned for c in "/\\\x00")
        or len(cleaned) > 120
    ):
        raise StorageError(
            f"invalid {what} name {name!r}: use letters, digits, spaces, - and _ "
            "(no slashes, not starting with a dot, at most 120 characters)"
        )
    return cleaned
