"""Models named by a Hugging Face id (loader/hub.py), offline on a pre-filled cache.

The cache is built the way huggingface_hub writes it (blobs named by their hash, snapshot
files linking to them, refs naming the commit of each branch) in a temporary directory, and
the real huggingface_hub reads it with HF_HUB_OFFLINE=1: no network, no stand-in."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.model_factory import make_tiny_llama
from loader.hub import local_dirname, parse_hub_id
from loader.manager import ModelManager

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache: Path, repo_id: str, revision: str, model_dir: Path) -> Path:
    """Put `model_dir`'s files into `cache` as huggingface_hub's snapshot of
    repo_id@revision; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for source in sorted(model_dir.iterdir()):
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / source.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / revision).write_text(COMMIT)
    return snapshot


def run(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp / "hub"),
        "HF_HOME": str(tmp / "hf-home"),
    }
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("meta-llama/Llama-3.2-1B", ("meta-llama/Llama-3.2-1B", None)),
        ("turboderp/Llama-3.1-8B-exl2:4.0bpw", ("turboderp/Llama-3.1-8B-exl2", "4.0bpw")),
        ("Qwen/Qwen3-0.6B@refs/pr/3", ("Qwen/Qwen3-0.6B", "refs/pr/3")),
        ("SmolLM2-135M-Instruct-exl2-4.0", None),  # a name in models/
        ("../secrets/model", None),
        ("/abs/path", None),
        ("models/x.gguf", None),
    ],
)
def test_parse_hub_id(text: str, parsed: tuple[str, str | None] | None) -> None:
    assert parse_hub_id(text) == parsed


def test_local_dirname() -> None:
    assert local_dirname("turboderp/Llama-exl2", "4.0bpw") == "turboderp_Llama-exl2_4.0bpw"
    assert local_dirname("meta-llama/Llama-3.2-1B", None) == "meta-llama_Llama-3.2-1B"
    assert local_dirname("meta-llama/Llama-3.2-1B", "main") == "meta-llama_Llama-3.2-1B"


def test_hub_id_from_the_cache_offline(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path / "src")
    snapshot = fill_cache(tmp_path / "hub", "someone/tiny-exl2", "4.0bpw", tmp_path / "src")
    models = tmp_path / "models"
    args = ["-m", "loader", "someone/tiny-exl2:4.0bpw", "--models-dir", str(models),
            "--device", "cpu", "-p", "Hello", "-n", "4", "-t", "0"]  # fmt: skip
    result = run(args, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "4 tokens at" in result.stderr  # it generated
    placed = models / "someone_tiny-exl2_4.0bpw"
    assert sorted(p.name for p in placed.iterdir()) == sorted(p.name for p in snapshot.iterdir())
    for file in placed.iterdir():  # hard links to the cache's blobs: no second copy
        assert not file.is_symlink()
        assert file.stat().st_ino == (snapshot / file.name).resolve().stat().st_ino
    assert not [p for p in models.iterdir() if p.name.startswith(".")]  # no partial left
    # The Model tab lists it like any other model, and a second run finds it in models/.
    assert [e.name for e in ModelManager(models, tmp_path / "loras").list_models()] == [placed.name]
    again = run(args, tmp_path)
    assert again.returncode == 0 and again.stdout == result.stdout


def test_a_cached_repo_without_weights_is_refused(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path / "src")
    (tmp_path / "src" / "model.safetensors").unlink()
    fill_cache(tmp_path / "hub", "someone/no-weights", "main", tmp_path / "src")
    models = tmp_path / "models"
    models.mkdir()
    result = run(["-m", "loader", "someone/no-weights", "--models-dir", str(models)], tmp_path)
    assert result.returncode == 1
    assert "someone/no-weights has no .safetensors weights" in result.stderr
    assert not any(models.iterdir())


def test_model_tab_download_panel_offline(tmp_path: Path) -> None:
    """The Model tab's handler (webui/hub_panel.py) on the same cache: the model lands in the
    models directory under its listed name; an id that is not cached says it is offline."""
    make_tiny_llama(tmp_path / "src")
    fill_cache(tmp_path / "hub", "someone/tiny", "main", tmp_path / "src")
    script = (
        "import json, sys; from pathlib import Path\n"
        "from loader.manager import ModelManager; from webui.hub_panel import download\n"
        "m = ModelManager(Path(sys.argv[1]), Path(sys.argv[1]) / 'loras')\n"
        "print(json.dumps([download(m, 'someone/tiny'), download(m, 'someone/other'),\n"
        "                  download(m, 'not an id'), [e.name for e in m.list_models()]]))\n"
    )
    result = run(["-c", script, str(tmp_path / "models")], tmp_path)
    assert result.returncode == 0, result.stderr
    found, missing, bad, listed = json.loads(result.stdout)
    assert found[1] == "someone_tiny" and "Downloaded someone/tiny" in found[0]
    assert missing[1] is None and "offline (HF_HUB_OFFLINE is set)" in missing[0]
    assert bad[1] is None and "not a Hugging Face id" in bad[0]
    assert listed == ["someone_tiny"]
