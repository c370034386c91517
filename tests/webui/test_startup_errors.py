"""What a new user's first mistakes give (issue 25): a port in use, a Hugging Face id that
cannot be had offline, an unknown architecture and a missing path each end the command
with one clear message before any model is loaded. Each runs the real command in a fresh
process; "before any model is loaded" is checked by the absence of the commands' "loading"
lines and by models directories left empty, never by timing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.model_factory import tiny_llama_config, write_tokenizer

ROOT = Path(__file__).resolve().parents[2]
# A generous limit for a stuck process, not a measurement.
LIMIT_S = 300


def run(args: list[str], tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",  # no test reaches the network
        "HF_HUB_CACHE": str(tmp / "hf-cache"),
        "HF_HOME": str(tmp / "hf-home"),
        **env,
    }
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=environment, capture_output=True, text=True,
        timeout=LIMIT_S,
    )  # fmt: skip


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another process (this one) listens on."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ui(tmp: Path, *flags: str) -> list[str]:
    models = tmp / "models"
    models.mkdir(exist_ok=True)
    # A free port unless the test picks one: the default 7860 may be taken on the machine
    # (a user's own UI), which would answer every test with "port in use".
    port = [] if "--port" in flags else ["--port", str(_free_port())]
    return ["ui.py", "--models-dir", str(models), "--user-data-dir", str(tmp / "ud"), *port, *flags]


def _nothing_loaded(result: subprocess.CompletedProcess[str], tmp: Path) -> None:
    # ui.py says "loading ..." / "preparing the default model" before it loads anything;
    # an empty models directory means the default model was not prepared either.
    assert "loading" not in result.stderr and "preparing" not in result.stderr
    assert not any((tmp / "models").iterdir())


def _one_message(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr  # one line, no traceback
    return lines[0]


def test_ui_port_in_use(tmp_path: Path, busy_port: int) -> None:
    result = run(_ui(tmp_path, "--port", str(busy_port)), tmp_path)
    assert result.returncode == 2
    line = _one_message(result)
    assert f"port {busy_port}" in line and "already in use" in line and "--port" in line
    _nothing_loaded(result, tmp_path)


@pytest.mark.parametrize("api", [("--api",), ("--extensions", "openai")])
def test_ui_api_port_in_use(tmp_path: Path, busy_port: int, api: tuple[str, ...]) -> None:
    # `--extensions openai` starts the same API server as `--api` (TGW's two spellings).
    flags = ("--port", str(_free_port()), *api, "--api-port", str(busy_port))
    result = run(_ui(tmp_path, *flags), tmp_path)
    assert result.returncode == 2
    line = _one_message(result)
    assert f"port {busy_port}" in line and "--api-port" in line
    _nothing_loaded(result, tmp_path)


def test_api_entry_port_in_use(tmp_path: Path, busy_port: int) -> None:
    (tmp_path / "models").mkdir()
    result = run(
        ["-m", "extensions.openai", "--model", "nowhere", "--models-dir",
         str(tmp_path / "models"), "--port", str(busy_port)],
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    line = _one_message(result)
    assert "already in use" in line and "--port" in line
    assert "model:" not in result.stderr


def test_ui_hub_id_offline_and_not_cached(tmp_path: Path) -> None:
    result = run(_ui(tmp_path, "--model", "someone/some-model:4.0bpw"), tmp_path)
    assert result.returncode == 2
    line = _one_message(result)
    assert "someone/some-model (revision 4.0bpw)" in line
    assert "offline (HF_HUB_OFFLINE is set)" in line and str(tmp_path / "hf-cache") in line
    _nothing_loaded(result, tmp_path)


def test_loader_hub_id_offline_and_not_cached(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    result = run(
        ["-m", "loader", "someone/some-model", "--models-dir", str(tmp_path / "models")],
        tmp_path,
    )
    assert result.returncode == 1
    assert "offline (HF_HUB_OFFLINE is set)" in _one_message(result)
    assert not any((tmp_path / "models").iterdir())


def test_missing_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    result = run(_ui(tmp_path, "--model", missing), tmp_path)
    assert result.returncode == 2
    line = _one_message(result)
    assert missing in line and "neither a model in" in line and "nor an existing path" in line
    _nothing_loaded(result, tmp_path)
    result = run(["-m", "loader", missing, "--models-dir", str(tmp_path / "models")], tmp_path)
    assert result.returncode == 1 and "nor an existing path" in _one_message(result)


def test_unknown_architecture_with_a_config_kestrel_cannot_read(tmp_path: Path) -> None:
    # Only the architecture and model type, none of the sizes Kestrel's config needs: the
    # message still says first what Kestrel runs.
    model = tmp_path / "bare"
    model.mkdir()
    config = {"architectures": ["FooBarForCausalLM"], "model_type": "foobar"}
    (model / "config.json").write_text(json.dumps(config))
    result = run(["-m", "loader", str(model), "--device", "cpu"], tmp_path)
    assert result.returncode == 1
    line = _one_message(result)
    assert "architecture 'FooBarForCausalLM' is not supported. Kestrel runs" in line
    assert "LlamaForCausalLM" in line and "'foobar'" in line


def test_unknown_architecture(tmp_path: Path) -> None:
    # A config and tokenizer but no weights: had any loader started loading, the error would
    # be about missing weights, not the architecture.
    model = tmp_path / "fancy"
    config = tiny_llama_config().to_dict()
    config.update(architectures=["FancyNewForCausalLM"], model_type="fancy_new")
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    write_tokenizer(model)
    result = run(["-m", "loader", str(model), "--device", "cpu"], tmp_path)
    assert result.returncode == 1
    line = _one_message(result)
    assert "architecture 'FancyNewForCausalLM' is not supported. Kestrel runs" in line
    assert "LlamaForCausalLM" in line and "Qwen3ForCausalLM" in line
    assert "pip install" not in line and "weights" not in line
