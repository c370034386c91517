"""What the browser tests share: starting `python ui.py` as a user does (a subprocess on
loopback), headless Chromium (found, launched, a desktop-sized context, a page opened once
the UI is ready; tests/webui/conftest.py's `browser` fixture), and helpers that drive
Gradio's widgets and wait on the page's state (never on sleeps)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
DESKTOP = {"width": 1400, "height": 1000}  # the viewport of a desktop browser window
SLOW = 120_000  # ms: the CI machine may be busy; waits end as soon as the page is ready
START_S = 180  # how long ui.py may take to listen, on a busy machine
# Layers of the test model where a test stops a long reply. With 2 layers a 3000-token
# reply took 9.5 s here, shorter than a browser starved at load 8 lagged behind the server,
# so Stop came after the end; 24 layers write ~73 tok/s (3000 tokens: ~40 s idle).
STOPPABLE_LAYERS = 24


def require_browser() -> ModuleType:
    """At a browser test module's import: skips the module without Chromium or Playwright,
    else returns playwright.sync_api."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(
            f"browser tests need Chromium at {CHROMIUM} (Debian: apt-get install -y chromium)",
            allow_module_level=True,
        )
    return pytest.importorskip("playwright.sync_api", reason="browser tests need playwright")


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Headless Chromium through Playwright until the block ends."""
    from playwright import sync_api

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def desktop_context(browser: Any) -> Iterator[Any]:
    """A fresh browser context (its own cookies and storage) with a desktop viewport."""
    context = browser.new_context(viewport=DESKTOP)
    try:
        yield context
    finally:
        context.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_ui(args: list[str], log_path: Path) -> Iterator[str]:
    """`python ui.py ARGS --port P` until the block ends; yields its URL once it listens.
    Raises RuntimeError with the log's tail when it exits or never listens."""
    port = free_port()
    log = log_path.open("w")
    command = [sys.executable, "ui.py", *args, "--port", str(port)]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ui.py exited with {proc.returncode}:\n{tail(log_path)}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"ui.py did not listen within {START_S} s:\n{tail(log_path)}"
                    ) from None
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-3000:]


def open_page(context, url: str):
    """A page on the UI, once it can take a message (the page load restored its state)."""
    page = context.new_page()
    page.set_default_timeout(SLOW)
    page.goto(url)
    page.wait_for_selector("#chat-input textarea:not([disabled])")
    return page


def tab(page, name: str) -> None:
    """Open tab `name`; on a narrow screen Gradio lists some under "More tabs"."""
    button = page.get_by_role("tab", name=name)
    if button.count() == 0 or not button.is_visible():
        page.get_by_role("button", name="More tabs").click()
        button = page.get_by_role("button", name=name, exact=True).locator("visible=true")
    button.click()


def choose(page, elem_id: str, label_start: str) -> None:
    """Pick the option whose label starts with `label_start` in a Gradio dropdown."""
    page.click(f"#{elem_id} input")
    page.locator(f'[role=option][aria-label^="{label_start}"]').first.click()


def set_value(page, elem_id: str, value) -> None:
    """Type into a slider's number box or a number/text field, and commit it."""
    box = page.locator(f"#{elem_id} input[type=number], #{elem_id} input, #{elem_id} textarea")
    box.first.fill(str(value))
    box.first.press("Enter")
    box.first.blur()


def status_tokens(text: str) -> int:
    match = re.search(r"(\d+) tokens", text)
    assert match, f"no token count in {text!r}"
    return int(match.group(1))


def bot_messages(page):
    return page.locator("#chatbot .bot.message")


def user_messages(page):
    return page.locator("#chatbot .user.message")


def send(page, text: str) -> None:
    page.fill("#chat-input textarea", text)
    page.click("#chat-send")


def chat_name(page) -> str:
    return page.locator("#chat-name textarea, #chat-name input").first.input_value()
