"""The API's two entries: `python -m extensions.openai` (API only, a subprocess) and the
openai extension's setup() (what ui.py --api does)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from helpers.model_factory import make_tiny_llama
from loader.manager import ModelManager
from serving import extensions, shared

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("entry") / "models"
    make_tiny_llama(root / "tiny")
    return root


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, headers: dict) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited: {process.communicate()[1][-2000:]}")
        try:
            if httpx.get(f"{url}/v1/internal/health", headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not come up")


def test_cli_serves_a_model_by_name(models_dir: Path) -> None:
    port = _free_port()
    command = [
        sys.executable, "-m", "extensions.openai", "--model", "tiny", "--models-dir",
        str(models_dir), "--port", str(port), "--api-key", "k1", "--device", "cpu",
        "--dtype", "float32",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, {"authorization": "Bearer k1"})
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]
        out = client.completions.create(model="tiny", prompt="Once", max_tokens=3)
        assert out.usage.completion_tokens <= 3 and out.choices[0].finish_reason
    finally:
        process.terminate()
        process.communicate(timeout=30)


def test_cli_reports_a_missing_model(models_dir: Path, capsys: pytest.CaptureFixture) -> None:
    from extensions.openai.__main__ import main

    saved = shared.manager, shared.args
    try:
        assert main(["--model", "nope", "--models-dir", str(models_dir)]) == 2
    finally:
        shared.manager, shared.args = saved
    assert "cannot load 'nope'" in capsys.readouterr().err


def test_extension_setup_starts_the_server(models_dir: Path) -> None:
    manager = ModelManager(models_dir)
    manager.load("tiny", "kestrel", device="cpu", dtype="float32")
    saved = shared.manager, shared.args
    shared.manager = manager
    shared.args = argparse.Namespace(api=True, api_port=0, api_key=None, admin_key=None)
    try:
        (ext,) = extensions.load_extensions(["openai"], strict=True)
        server = ext.module.server
        assert server.host == "127.0.0.1" and server.port > 0
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]
        server.stop()
        ext.module.server = None
    finally:
        extensions.load_extensions([])
        shared.manager, shared.args = saved
        manager.unload()
