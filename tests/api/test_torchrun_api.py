"""The API server under torchrun (issue 33): rank 0 serves HTTP, the other ranks serve rank
0; on the CPU (gloo), with the real openai client. Greedy text equals a one-process
server's, model switching is refused, and Ctrl+C ends every rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from extensions.openai.__main__ import build_parser, load_model
from extensions.openai.server import run_api_server
from helpers.hostile_server import free_port
from helpers.model_factory import make_tiny_llama
from loader.manager import ModelManager

ROOT = Path(__file__).resolve().parents[2]
KEY = "k33"
PROMPT = "hello world"


def _greedy(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    return reply.choices[0].text


def _one_process_text(models_dir: Path) -> str:
    """What `python -m extensions.openai --model tiny --device cpu` answers: its own load
    path and a real server, in this process."""
    args = build_parser().parse_args(["--model", "tiny", "--models-dir", str(models_dir),
                                      "--device", "cpu"])  # fmt: skip
    manager = ModelManager(models_dir)
    load_model(manager, args)
    server = run_api_server("127.0.0.1", 0, api_key=KEY, admin_key=None, manager=manager)
    try:
        return _greedy(server.url)
    finally:
        server.stop()
        manager.unload()


def _wait_serving(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until /v1/models lists the model (the load over both ranks is done); a guard against
    a hang, not a time limit on the load."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"torchrun exited ({process.returncode}):\n{log.read_text()}")
        try:
            listed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            if listed.status_code == 200 and listed.json()["data"]:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the server never listed its model:\n{log.read_text()}")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _ctrl_c(pid: int) -> None:
    os.killpg(pid, signal.SIGINT)  # a terminal's Ctrl+C: every process of the group


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)  # `kill PID` of torchrun, which passes it on to its ranks


@pytest.mark.slow
@pytest.mark.parametrize("stop", [_ctrl_c, _kill], ids=["ctrl-c", "sigterm"])
def test_api_server_under_torchrun(tmp_path: Path, stop: Callable[[int], None]) -> None:
    models_dir = tmp_path / "models"
    make_tiny_llama(models_dir / "tiny")
    expected = _one_process_text(models_dir)
    assert expected.strip(), "the one-process server generated no text"

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "torchrun.log"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "-m", "extensions.openai", "--model", "tiny",
        "--models-dir", str(models_dir), "--tp", "--device", "cpu", "--port", str(port),
        "--api-key", KEY,
    ]  # fmt: skip
    with log.open("wb") as out:
        # Its own process group: the test's Ctrl+C reaches torchrun and both ranks, as a
        # terminal's does, and the group tells whether any of them is left.
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_serving(url, process, log)
        auth = {"Authorization": f"Bearer {KEY}"}
        for route, body in (("load", {"model_name": "tiny"}), ("unload", {})):
            refused = httpx.post(f"{url}/v1/internal/model/{route}", json=body, headers=auth)
            assert refused.status_code == 409, refused.text
            assert "torchrun" in refused.json()["error"]["message"]
        assert _greedy(url) == expected

        stop(process.pid)
        process.wait(timeout=600)
        deadline = time.monotonic() + 120
        while _group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(process.pid), "a rank outlived torchrun"
        said = log.read_text()
        assert "model unloaded" in said, said  # rank 0 unloaded, which stops rank 1 ...
        assert "rank 0 unloaded the model: this rank stops" in said, said  # ... which left
        # torchrun itself reports the signal it got with a traceback; no rank may.
        assert said.count("Traceback") == said.count("SignalException: Process"), said
    finally:
        if _group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
