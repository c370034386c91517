"""TGW's `modules.chat.generate_chat_prompt`: the prompt for state["history"] + user_input."""

from __future__ import annotations

from typing import Any

from serving import extensions as _extensions
from serving import shared as _shared


def history_to_messages(history: dict[str, Any], user_input: str) -> list[dict[str, str]]:
    """TGW history ({"internal": [[user, bot], ...]}) plus the new input as messages."""
    messages: list[dict[str, str]] = []
    for user, bot in history.get("internal", []):
        if user:
            messages.append({"role": "user", "content": user})
        if bot:
            messages.append({"role": "assistant", "content": bot})
    messages.append({"role": "user", "content": user_input})
    return messages


def generate_chat_prompt(user_input: str, state: dict[str, Any], **kwargs: Any) -> str:
    # As in TGW, the other chat hooks ran before this is called; only the bot prefix is
    # part of the prompt.
    messages = history_to_messages(state.get("history") or {}, user_input)
    prompt = _shared.manager.current().apply_chat_template(messages, add_generation_prompt=True)
    return prompt + _extensions.apply_bot_prefix_modifier("", state)
