"""The web UI as a new user meets it, in headless Chromium: a first start (`python ui.py` on a
models directory holding only the default model's import) serves the page at once and
converts the model to EXL2 meanwhile; a later start (conftest's `default_model_dir`: that
conversion, reused) loads it at start and a chat message gets a streamed answer. Slow (one
conversion per session, helpers.default_model) and needs the network."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import default_model

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(f"browser tests need Chromium at {CHROMIUM}", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need playwright")

pytestmark = [pytest.mark.browser, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
SLOW = 180_000  # ms


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ui.py exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    proc.kill()
    pytest.fail(f"ui.py did not listen within 240 s:\n{log.read_text()[-3000:]}")


def _wait_logged(proc: subprocess.Popen, log: Path, line_start: str) -> None:
    """Wait until ui.py's log has a line starting with `line_start`; fail with the log if
    the server exits or says it could not load. The generous limit only guards a hang: the
    time a step takes depends on the machine's load, which is no test's business."""
    deadline = time.monotonic() + 120 * 60
    while time.monotonic() < deadline:
        text = log.read_text()
        if any(line.startswith(line_start) for line in text.splitlines()):
            return
        if proc.poll() is not None or "[kestrel ui] could not " in text:
            pytest.fail(f"ui.py did not load the model:\n{text[-3000:]}")
        time.sleep(1.0)
    pytest.fail(f"ui.py logged no {line_start!r} within 2 hours:\n{log.read_text()[-3000:]}")


def test_the_page_is_served_while_the_default_model_is_prepared(tmp_path: Path) -> None:
    """A first start with only the default model's FP16 import: ui.py serves the page at
    once and shows the conversion's progress there; the chat says so; once converted, the
    model is loaded and the page says that too, without a reload. Its conversion then
    serves the session's other users of the default model (helpers.default_model)."""
    from loader.default_model import DEFAULT_MODEL, DEFAULT_MODEL_DIRNAME, ensure_packaged_model

    models = tmp_path / "models"
    ensure_packaged_model(DEFAULT_MODEL, models, quiet=True)  # the FP16 import, no EXL2 yet
    port = _free_port()
    log = tmp_path / "server.log"
    command = [
        sys.executable, "ui.py", "--models-dir", str(models),
        "--user-data-dir", str(tmp_path / "user_data"), "--port", str(port),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_listening(proc, port, log)
        assert "loaded" not in log.read_text()  # served before the model was ready
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--no-first-run", "--disable-sync"],
            )  # fmt: skip
            page = browser.new_page()
            page.set_default_timeout(SLOW)
            expect = sync_api.expect
            expect.set_options(timeout=SLOW)
            page.goto(f"http://127.0.0.1:{port}")
            banner = page.locator("#startup-status")
            expect(banner).to_contain_text("Preparing the default model")
            page.wait_for_selector("#chat-input textarea:not([disabled])")
            page.fill("#chat-input textarea", "Hello?")
            page.click("#chat-send")
            expect(page.locator("#chat-error")).to_contain_text("Preparing the default model")
            # The conversion takes minutes on a small CPU, many more on a loaded one: wait
            # for the server to say it is done (or to fail), then for the page to follow.
            _wait_logged(proc, log, "[kestrel ui] loaded ")
            default_model.offer(models / DEFAULT_MODEL_DIRNAME)
            expect(banner).to_be_hidden()
            page.get_by_role("tab", name="Model").click()
            expect(page.locator("#model-status")).to_contain_text("Loaded SmolLM2")
            browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_default_model_chats_in_the_browser(default_model_dir: Path, tmp_path: Path) -> None:
    from loader.default_model import DEFAULT_MODEL_DIRNAME

    port = _free_port()
    log = tmp_path / "server.log"
    command = [
        sys.executable, "ui.py", "--models-dir", str(default_model_dir.parent),
        "--user-data-dir", str(tmp_path / "user_data"), "--port", str(port),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_listening(proc, port, log)
        assert f"loading {DEFAULT_MODEL_DIRNAME}" in log.read_text()
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--no-first-run", "--disable-sync"],
            )  # fmt: skip
            page = browser.new_page()
            page.set_default_timeout(SLOW)
            sync_api.expect.set_options(timeout=SLOW)
            page.goto(f"http://127.0.0.1:{port}")
            page.wait_for_selector("#chat-input textarea")
            page.fill("#chat-input textarea", "What is the capital of France?")
            page.click("#chat-send")
            # The status ends with the finish reason once the streamed answer is complete.
            sync_api.expect(page.locator("#chat-status")).to_contain_text(
                re.compile(r"tok/s.*, (stop|length)\b")
            )
            reply = page.locator("#chatbot .bot.message").last
            sync_api.expect(reply).not_to_be_empty()
            assert len(reply.inner_text().split()) >= 2, reply.inner_text()
            browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
