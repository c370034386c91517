"""Screenshots of the web UI's main tabs for the docs, taken with headless Chromium.

    python tools/ui_screenshots.py [--out docs/screenshots] [-- ui.py flags...]

Starts `ui.py` on a free loopback port (by default with the default model and a scratch
user-data folder), waits until it has loaded its model (on a first run it serves the page
while it prepares the default model, and a question then only gets "Preparing..."), asks the
chat one question, and saves chat.png, notebook.png,
parameters.png and model.png, and chat-phone.png (the same chat on a 390 px wide phone
screen). Needs Chromium at /usr/bin/chromium and playwright.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", "--disable-sync"]  # fmt: skip


LOADED = "[kestrel ui] loaded "  # what ui.py prints once its model is loaded


def _echo_until_loaded(stream: IO[str], loaded: threading.Event) -> None:
    """Pass ui.py's output through (the pipe must keep draining) and set `loaded` at the
    line that says the model is loaded."""
    for line in stream:
        sys.stdout.write(line)
        if line.startswith(LOADED):
            loaded.set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    parser.add_argument("--question", default="What is the capital of France?")
    parser.add_argument("ui_args", nargs="*", help="extra ui.py flags (after --)")
    args = parser.parse_args()
    from playwright.sync_api import expect, sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    with tempfile.TemporaryDirectory() as user_data:
        command = [sys.executable, "ui.py", "--port", str(port), "--user-data-dir", user_data]
        server = subprocess.Popen(
            [*command, *args.ui_args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # each line as it is printed
        )
        loaded = threading.Event()
        assert server.stdout is not None
        threading.Thread(
            target=_echo_until_loaded, args=(server.stdout, loaded), daemon=True
        ).start()
        try:
            # A first run downloads and converts the default model: minutes on a small CPU.
            deadline = time.monotonic() + 1800
            while not loaded.wait(timeout=1):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("ui.py did not load its model")
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("ui.py did not start") from None
                    time.sleep(1)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.set_default_timeout(300_000)
                expect.set_options(timeout=300_000)
                page.goto(f"http://127.0.0.1:{port}")
                page.wait_for_selector("#chat-input textarea:not([disabled])")
                page.get_by_role("tab", name="Parameters").click()
                box = page.locator("#param-max_new_tokens input[type=number]")
                box.fill("160")
                box.press("Enter")
                # Greedy: a 135M model answers a fact question best without sampling.
                page.click("#preset input")
                page.locator('[role=option][aria-label="Deterministic"]').click()
                expect(page.locator("#params-status")).to_contain_text("Deterministic")
                page.get_by_role("tab", name="Chat").click()
                page.fill("#chat-input textarea", args.question)
                page.click("#chat-send")
                expect(page.locator("#chat-status")).to_contain_text("tok/s")
                expect(page.locator("#chat-status")).to_contain_text(re.compile("stop|length"))
                page.screenshot(path=args.out / "chat.png")
                for name in ("Notebook", "Parameters", "Model"):
                    page.get_by_role("tab", name=name).click()
                    time.sleep(1)
                    page.screenshot(path=args.out / f"{name.lower()}.png", full_page=True)
                # A phone: the page reopens the latest chat, the one just had.
                phone = browser.new_page(viewport={"width": 390, "height": 844}, is_mobile=True)
                phone.set_default_timeout(300_000)
                phone.goto(f"http://127.0.0.1:{port}")
                phone.wait_for_selector("#chat-input textarea:not([disabled])")
                expect(phone.locator("#chatbot .bot.message").last).not_to_be_empty()
                phone.screenshot(path=args.out / "chat-phone.png")
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"screenshots in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
