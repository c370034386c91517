"""Saved chats and remembered UI settings, under the user-data directory.

    user_data/
      chats/<name>.json     {"name", "updated", "system_prompt", "messages": [{role, content}]}
      presets/<name>.yaml   (webui.presets)
      settings.yaml         the last parameter values, preset, system prompt, model and
                            load options: restored on the next start

Every write is atomic (webui.storage): a crash or a concurrent save leaves either the
previous file or the new one. A chat is saved after every reply, so the conversation on
disk is never more than the reply in flight behind the page.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from webui.storage import StorageError, read_json, read_yaml, safe_name, write_json, write_yaml

Message = dict[str, str]


def new_chat_name() -> str:
    return time.strftime("chat-%Y%m%d-%H%M%S")


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

    def save_chat(self, name: str, messages: list[Message], system_prompt: str = "") -> Path:
        clean = safe_name(name, "chat")
        path = self.chats_dir / f"{clean}.json"
        checked = _check_messages(messages, f"chat {clean!r}")
        write_json(
            path,
            {
                "name": clean,
                "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "system_prompt": system_prompt,
                "messages": checked,
            },
        )
        return path

    def load_chat(self, name: str) -> tuple[list[Message], str]:
        """(messages, system prompt) of saved chat `name`."""
        path = self.chats_dir / f"{safe_name(name, 'chat')}.json"
        data = read_json(path)
        if not isinstance(data, dict):
            raise StorageError(f"{path} must hold a JSON object")
        system_prompt = data.get("system_prompt", "")
        if not isinstance(system_prompt, str):
            raise StorageError(f"{path}: 'system_prompt' must be a string")
        return _check_messages(data.get("messages", []), str(path)), system_prompt

    def delete_chat(self, name: str) -> None:
        path = self.chats_dir / f"{safe_name(name, 'chat')}.json"
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
