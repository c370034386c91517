"""Saved chats and remembered UI settings, under the user-data directory.

    user_data/
      chats/<name>.json     {"name", "updated", "revision", "system_prompt",
                             "messages": [{role, content}]}
      presets/<name>.yaml   (webui.presets)
      settings.yaml         the last parameter values, preset, system prompt, model and
                            load options: restored on the next start

Every write is atomic (serving.storage): a crash or a concurrent save leaves either the
previous file or the new one. A chat is saved after every reply, so the conversation on
disk is never more than the reply in flight behind the page.

Every chat has a name of its own (date, time and a random part: two tabs starting a chat in
the same second never share a file), and a revision counted up on every save. A page saves
with the revision it last saw; when another tab saved the same chat in between, the page's
version goes to a new chat instead of overwriting the other (see `save_chat`).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.storage import (
    StorageError,
    locked,
    read_json,
    read_yaml,
    safe_name,
    write_held,
    write_yaml,
)

Message = dict[str, str]
TITLE_CHARS = 60  # of the first user message, in the Past chats list


def new_chat_name() -> str:
    """A name no other page will pick: the time plus 6 random hex digits."""
    return time.strftime("chat-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


@dataclass(frozen=True)
class Saved:
    """Where a save went: `name` differs from the name asked for when another page had
    saved that chat since this one last saw it (`forked`)."""

    name: str
    revision: int
    forked: bool = False


def title_of(messages: list[Message]) -> str:
    """The first user message on one line, shortened: what the Past chats list shows."""
    first = next((m["content"] for m in messages if m["role"] == "user"), "")
    line = " ".join(first.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


def _check_messages(messages: Any, source: str) -> list[Message]:
    if not isinstance(messages, list):
        raise StorageError(f"{source}: 'messages' must be a list")
    out = []
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ("user", "assistant", "system")
            or not isinstance(m.get("content"), str)
        ):
            raise StorageError(
                f"{source}: message {i} must be {{'role': 'user'|'assistant'|'system', "
                f"'content': str}}, got {m!r}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


class UserData:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.chats_dir = self.root / "chats"
        self.presets_dir = self.root / "presets"
        self.settings_path = self.root / "settings.yaml"
        # update_settings reads, merges and writes: two browser tabs must not lose each
        # other's changes in between.
        self._settings_lock = threading.Lock()

    # -- chats ------------------------------------------------------------------------
    def chat_names(self) -> list[str]:
        """Saved chats, the most recently updated first."""
        if not self.chats_dir.is_dir():
            return []
        files = [p for p in self.chats_dir.glob("*.json") if not p.name.startswith(".")]
        files.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        return [p.stem for p in files]

    def chat_choices(self) -> list[tuple[str, str]]:
        """(label, name) per saved chat, newest first; the label is the chat's title (its
        first user message) and when it was saved. A file that does not read is listed by
        name, so it can still be opened (to see its error) or deleted."""
        out = []
        for name in self.chat_names():
            try:
                data = read_json(self._chat_path(name))
                title = title_of(_check_messages(data.get("messages", []), name))
                when = str(data.get("updated", "")).replace("T", " ")[:16]
                label = f"{title or name} · {when}" if when else (title or name)
            except (StorageError, AttributeError):
                label = name
            out.append((label, name))
        return out

    def latest_chat(self) -> str | None:
        names = self.chat_names()
        return names[0] if names else None

    def _chat_path(self, name: str) -> Path:
        return self.chats_dir / f"{safe_name(name, 'chat')}.json"

    def chat_revision(self, name: str) -> int | None:
        """The revision of saved chat `name`, or None when there is no such file."""
        path = self._chat_path(name)
        if not path.is_file():
            return None
        data = read_json(path)
        revision = data.get("revision", 0) if isinstance(data, dict) else 0
        return revision if isinstance(revision, int) else 0

    def save_chat(
        self,
        name: str,
        messages: list[Message],
        system_prompt: str = "",
        seen_revision: int | None = -1,
    ) -> Saved:
        """Save the chat; `seen_revision` is the revision this page last saw (None: the
        page started this chat, so no file should be there yet; -1: overwrite whatever is
        there). When the file on disk is at another revision, another page saved it in
        between: the chat goes to a new name instead, and nothing of the other is lost."""
        clean = safe_name(name, "chat", new=True)
        checked = _check_messages(messages, f"chat {clean!r}")
        path = self.chats_dir / f"{clean}.json"
        with locked(path):  # read-compare-write as one step
            current = self.chat_revision(clean)
            forked = seen_revision != -1 and current is not None and current != seen_revision
            if forked:
                clean = new_chat_name()
                path, current = self.chats_dir / f"{clean}.json", None
            revision = (current or 0) + 1
            data = {
                "name": clean,
                "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "revision": revision,
                "system_prompt": system_prompt,
                "messages": checked,
            }
            write_held(path, json.dumps(data, ensure_ascii=False, indent=2) + "\n")
        return Saved(clean, revision, forked)

    def load_chat(self, name: str) -> tuple[list[Message], str]:
        """(messages, system prompt) of saved chat `name`."""
        path = self._chat_path(name)
        data = read_json(path)
        if not isinstance(data, dict):
            raise StorageError(f"{path} must hold a JSON object")
        system_prompt = data.get("system_prompt", "")
        if not isinstance(system_prompt, str):
            raise StorageError(f"{path}: 'system_prompt' must be a string")
        return _check_messages(data.get("messages", []), str(path)), system_prompt

    def delete_chat(self, name: str) -> None:
        path = self._chat_path(name)
        if not path.is_file():
            raise StorageError(f"no chat named {name!r} in {self.chats_dir}")
        path.unlink()

    # -- settings ---------------------------------------------------------------------
    def load_settings(self) -> dict[str, Any]:
        """The remembered settings, or {} when none were saved or the file is unreadable
        (a broken settings file must not keep the UI from starting; it is overwritten on
        the next save)."""
        if not self.settings_path.is_file():
            return {}
        try:
            data = read_yaml(self.settings_path)
        except StorageError:
            return {}
        return data if isinstance(data, dict) else {}

    def save_settings(self, settings: dict[str, Any]) -> None:
        write_yaml(self.settings_path, settings)

    def update_settings(self, **changes: Any) -> dict[str, Any]:
        with self._settings_lock:
            settings = {**self.load_settings(), **changes}
            self.save_settings(settings)
            return settings
