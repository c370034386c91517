"""Hostile model and adapter files (issue 26): every loader, the automatic fallback to
transformers included, refuses what Kestrel's own loader refuses; no checkpoint code runs;
regular expressions and templates from downloaded files cannot freeze the process; the
API server's cache sizing is right where it applies (a GPU) and where it does not (CPU).
Real files throughout: checkpoints saved by transformers, safetensors written byte by byte.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import loader
from engine.cache_sizing import memory_sized_tokens
from engine.config import ConfigError
from engine.lora import LoraError
from engine.lora.patterns import UnsafePatternError, check_pattern
from engine.weights import WeightError
from extensions.openai.load_defaults import with_cache_default
from helpers.model_factory import make_tiny_llama
from serving import storage

ROOT = Path(__file__).resolve().parents[2]
CPU = dict(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile-files") / "tiny"
    make_tiny_llama(path)
    return path


def _copy_without_weights(tiny: Path, dst: Path) -> Path:
    shutil.copytree(tiny, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


# -- 6. the fallback loader and path confinement ---------------------------------------------
@pytest.mark.parametrize("name", [None, "transformers", "kestrel"])
def test_index_shards_outside_the_folder_are_refused_by_every_loader(
    tiny: Path, tmp_path: Path, name: str | None
) -> None:
    outside = tmp_path / "outside" / "evil"
    outside.mkdir(parents=True)
    shutil.copy(tiny / "model.safetensors", outside / "model.safetensors")
    model = _copy_without_weights(tiny, tmp_path / "a" / "b" / "model")
    header_names = json.loads(_header(tiny / "model.safetensors"))
    # a/b/model/../../../outside is tmp_path/outside: a real shard, outside the folder
    shard = "../../../outside/evil/model.safetensors"
    weight_map = {k: shard for k in header_names if not k.startswith("__")}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightError, match="shard .* points outside|'..' leaves"):
        loader.load(model, name, **CPU)


@pytest.mark.parametrize("name", [None, "transformers", "kestrel"])
def test_a_weights_symlink_out_of_the_folder_is_refused(
    tiny: Path, tmp_path: Path, name: str | None
) -> None:
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(tiny / "model.safetensors", outside)
    model = _copy_without_weights(tiny, tmp_path / "model")
    os.symlink(outside, model / "model.safetensors")
    with pytest.raises(WeightError, match="points outside"):
        loader.load(model, name, **CPU)


def _hub_snapshot(tiny: Path, cache: Path, blob_dir: Path) -> Path:
    """A Hugging Face cache entry as huggingface_hub lays it out: the snapshot's files are
    relative symlinks to content-named files in `blob_dir` (the repository's blobs/)."""
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    blob_dir.mkdir(parents=True, exist_ok=True)
    for i, file in enumerate(sorted(p for p in tiny.iterdir() if p.is_file())):
        blob = blob_dir / f"blob{i}"
        shutil.copy(file, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    return snapshot


def test_a_hugging_face_cache_snapshot_loads(tiny: Path, tmp_path: Path) -> None:
    # Its symlinks leave the snapshot folder but stay in the repository's blobs/.
    repo_blobs = tmp_path / "hub" / "models--org--tiny" / "blobs"
    snapshot = _hub_snapshot(tiny, tmp_path / "hub", repo_blobs)
    model = loader.load(snapshot, "kestrel", **CPU)
    assert model.generate("hello", {"max_new_tokens": 2, "temperature": 0}) is not None
    model.unload()


def test_a_snapshot_linking_outside_its_repository_is_refused(tiny: Path, tmp_path: Path):
    snapshot = _hub_snapshot(tiny, tmp_path / "hub", tmp_path / "elsewhere")
    with pytest.raises(WeightError, match="points outside"):
        loader.load(snapshot, None, **CPU)


def test_huge_layer_count_is_refused_before_transformers_allocates(
    tiny: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    _edit_config(model, num_hidden_layers=10**9)
    for name in (None, "transformers"):
        with pytest.raises(ConfigError, match="num_hidden_layers"):
            loader.load(model, name, **CPU)


def test_unsupported_architecture_still_falls_back_to_transformers(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from helpers.model_factory import write_tokenizer

    config = GPT2Config(vocab_size=384, n_embd=32, n_layer=2, n_head=2, n_positions=128)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    write_tokenizer(tmp_path / "gpt2")
    model = loader.load(tmp_path / "gpt2", None, **CPU)
    try:
        assert model.loader_name == "transformers"
        assert model.generate("Once", {"max_new_tokens": 2, "temperature": 0}) is not None
    finally:
        model.unload()


# -- 7. no checkpoint code runs --------------------------------------------------------------
def test_remote_code_never_runs_even_when_the_user_answers_yes(tmp_path: Path) -> None:
    model = tmp_path / "remote"
    model.mkdir()
    marker = tmp_path / "code-ran"
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil",
                "architectures": ["EvilForCausalLM"],
                "auto_map": {
                    "AutoConfig": "evil.EvilConfig",
                    "AutoModelForCausalLM": "evil.EvilForCausalLM",
                },
            }
        )
    )
    (model / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    shutil.copy(_tokenizer_dir(tmp_path) / "tokenizer.json", model / "tokenizer.json")
    done = subprocess.run(
        [sys.executable, "-m", "loader", str(model), "--loader", "transformers"],
        cwd=ROOT, input="y\ny\ny\n", capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert not marker.exists(), "the checkpoint's Python ran"
    assert done.returncode != 0
    assert "trust_remote_code" in done.stderr + done.stdout


def _tokenizer_dir(tmp_path: Path) -> Path:
    from helpers.model_factory import write_tokenizer

    write_tokenizer(tmp_path / "tok")
    return tmp_path / "tok"


# -- 5. adapter patterns ---------------------------------------------------------------------
def test_backtracking_rank_pattern_is_refused_at_once(tiny: Path, tmp_path: Path) -> None:
    adapter = tmp_path / "evil"
    adapter.mkdir()
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (adapter / "adapter_config.json").write_text(
        json.dumps({**config, "rank_pattern": {"([a-z_.0-9]+)+!": 8}})
    )
    for name in ("kestrel", "transformers"):
        model = loader.load(tiny, name, **CPU)
        try:
            with pytest.raises(LoraError, match="rank_pattern.*exponential"):
                model.load_lora(adapter, "evil")
        finally:
            model.unload()


@pytest.mark.parametrize(
    "pattern", [r"([a-z_.0-9]+)+!", r"(a|aa)+$", r"(x*)*y", r"((ab)+c?)*d", "a" * 600]
)
def test_unsafe_patterns(pattern: str) -> None:
    with pytest.raises(UnsafePatternError):
        check_pattern(pattern)


@pytest.mark.parametrize(
    "pattern",
    [
        r"model.layers.3.self_attn.q_proj",
        r"layers\.\d+\.mlp\.down_proj",
        r".*q_proj",
        r"(q|v)_proj",
    ],
)
def test_real_patterns_pass(pattern: str) -> None:
    check_pattern(pattern)


# -- 9. small ones ---------------------------------------------------------------------------
def _header(file: Path) -> bytes:
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + length]


def test_deeply_nested_safetensors_header_is_a_weight_error(tiny: Path, tmp_path: Path) -> None:
    model = _copy_without_weights(tiny, tmp_path / "model")
    header = b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    for name in (None, "kestrel", "transformers"):
        with pytest.raises(WeightError, match="nested too deeply"):
            loader.load(model, name, **CPU)


def test_lock_files_do_not_outlive_a_write(tmp_path: Path) -> None:
    target = tmp_path / "chats" / "a.json"
    storage.atomic_write_text(target, "one")
    storage.atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.json"]


# -- 10. the API server's cache sizing -------------------------------------------------------
def test_memory_sizing_does_not_apply_on_the_cpu(
    tiny: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = with_cache_default({**CPU, "max_seq_len": 128, "page_size": 16}, tiny, None)
    assert options["cache_memory_fraction"] > 0  # asked for by default on the kestrel loader
    assert "cache_memory_fraction" not in with_cache_default({"cache_tokens": 512}, tiny, None)
    with caplog.at_level(logging.INFO, logger="engine.engine"):
        model = loader.load(tiny, None, **options)
    try:
        assert model.info()["cache_tokens"] == 128  # one context, as without the option
        assert "KV cache: 128 tokens" in caplog.text and "GPUs only" in caplog.text
    finally:
        model.unload()
    sized = memory_sized_tokens(
        fraction=0.9, device=torch.device("cpu"), model_dir=tiny, token_bytes=1024,
        max_seq_len=128, max_batch=4, prefill_chunk=64, vocab_size=384, page_size=16,
    )  # fmt: skip
    assert sized is None


@pytest.mark.gpu
def test_memory_sizing_on_a_gpu(tiny: Path, caplog: pytest.LogCaptureFixture) -> None:
    options = with_cache_default({"device": "cuda", "max_seq_len": 256}, tiny, None)
    with caplog.at_level(logging.INFO, logger="engine.engine"):
        model = loader.load(tiny, None, **options)
    try:
        tokens = model.info()["cache_tokens"]
        # A tiny model on a GPU with GBs free: the cap (max_batch full contexts) is reached.
        assert tokens == 64 * 256
        assert f"KV cache: {tokens} tokens" in caplog.text and "free GPU memory" in caplog.text
    finally:
        model.unload()


def test_every_auto_class_load_passes_trust_remote_code_false() -> None:
    """transformers' Auto* classes are the ones that run a checkpoint's own Python (its
    auto_map); left unset, trust_remote_code makes transformers ask on the terminal, and a
    "y" piped in runs the code. Every such call in the shipped code says False."""
    import ast

    from helpers.source_audit import dotted, is_false, shipped_files

    calls = []
    for path in shipped_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and dotted(node.func).endswith(".from_pretrained"):
                owner = dotted(node.func).rsplit(".", 2)[-2]
                if owner.startswith("Auto"):
                    flag = {k.arg: k.value for k in node.keywords}.get("trust_remote_code")
                    calls.append((f"{path.relative_to(ROOT)}:{node.lineno}", flag))
    assert calls  # the loader's and the GGUF import's
    assert [where for where, flag in calls if flag is None or not is_false(flag)] == []
