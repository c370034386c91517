"""Shared by the hostile-request tests: chat templates taken from real models' and
hostile ones, and starting a real `python -m extensions.openai` process."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import httpx

# Qwen2.5's way of writing an assistant's earlier tool calls (its template's own lines).
TOOL_CALL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% if message.tool_calls %}{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if tools %}{% for tool in tools %}{{ tool | tojson }}{% endfor %}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Nested loops of 10^10 iterations that output nothing, only when tools are sent.
LOOP_TEMPLATE = (
    "{% if tools %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}{% endif %}"
    "{% for message in messages %}{{ message.content }}{% endfor %}"
)


def set_template(model_dir: Path, template: str) -> None:
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": template}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            said = process.stderr.read()[-2000:] if process.stderr else "(see its log)"
            raise AssertionError(f"the server exited: {said}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not start")
