"""The shipped calibration mix and the held-out evaluation text (issue 29): every source is
used, rows of the sources take turns, several calibration files work, and no evaluation
text is in the calibration text (a measurement that could overfit would not show it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import loader
from engine.quantizer import ConvertError, ConvertOptions, convert
from engine.quantizer import calibration as cal
from engine.quantizer.pipeline import (
    DEFAULT_ROWS,
    FAST_ROWS,
    SCORE_TOKENS_CPU,
    _row_settings,
    _score_tokens,
)
from helpers.model_factory import make_tiny_llama
from tools.perplexity import DOMAINS, HELDOUT_DIR, domain_perplexities, domain_texts, main
from tools.perplexity import perplexity as text_perplexity

ROWS = dict(rows=6, length=64, measure_rows=3, measure_length=64)


def _blocks(text: str, least: int) -> set[str]:
    """Paragraphs (blank-line separated) of at least `least` characters, whitespace-normalized."""
    return {" ".join(b.split()) for b in text.split("\n\n") if len(b.strip()) >= least}


def test_heldout_text_is_not_calibration_text():
    calibration = "\n\n".join(cal.default_calibration_texts())
    cal_blocks = _blocks(calibration, 200)
    cal_lines = {line.strip() for line in calibration.splitlines() if len(line.strip()) >= 80}
    for domain in DOMAINS:
        text = (HELDOUT_DIR / f"{domain}.utf8").read_text(encoding="utf-8")
        shared = _blocks(text, 200) & cal_blocks
        assert not shared, f"{domain}: {len(shared)} paragraphs are in the calibration text"
        if domain != "code":  # short lines of code (imports, braces) recur across projects
            lines = {line.strip() for line in text.splitlines() if len(line.strip()) >= 80}
            assert not lines & cal_lines, f"{domain}: lines shared with the calibration text"


def test_default_mix_has_every_source_and_rows_take_turns():
    texts = cal.default_calibration_texts()
    assert len(texts) == len(cal.DEFAULT_SOURCES) >= 6
    assert all(len(t) > 50_000 for t in texts)
    assert all("<doc" not in t for t in texts)  # attribution lines are not calibrated on

    class Chars:  # one token per character: a row is `length` characters of one source
        def encode(self, text: str, *, add_bos: bool | None = True) -> list[int]:
            return [ord(c) for c in text]

    rows = cal.calibration_rows(Chars(), texts, rows=len(texts) * 2, length=32)
    firsts = ["".join(map(chr, row.tolist())) for row in rows]
    for i, text in enumerate(texts):
        assert firsts[i] == text[:32] and firsts[len(texts) + i] == text[32:64]


def test_several_calibration_files_and_fast_rows(tmp_path):
    path = tmp_path / "fp"
    make_tiny_llama(path)
    a, b = tmp_path / "a.txt", tmp_path / "b.jsonl"
    a.write_text("The quick brown fox jumps over the lazy dog. " * 200, encoding="utf-8")
    lines = [json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}"}) for i in range(80)]
    b.write_text("\n".join(lines), encoding="utf-8")
    out = tmp_path / "q"
    options = ConvertOptions(bits=4.0, device="cpu", progress=False, calibration=[a, b], **ROWS)
    result = convert(path, out, options)
    assert result.finished
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["calibration"]["dataset"] == "a.txt + b.jsonl" and qc["calibration"]["rows"] == 6
    missing = ConvertOptions(**{**options.__dict__, "calibration": [a, tmp_path / "x.txt"]})
    with pytest.raises(ConvertError, match="not found"):
        convert(path, tmp_path / "q2", missing)
    assert not (tmp_path / "q2").exists() and not (tmp_path / "q2.partial").exists()
    cpu = torch.device("cpu")
    assert _row_settings(ConvertOptions(bits=4.0), cpu) == DEFAULT_ROWS["cpu"]
    assert _row_settings(ConvertOptions(bits=4.0, fast=True), cpu) == FAST_ROWS["cpu"]
    assert _row_settings(ConvertOptions(bits=4.0, fast=True, rows=5), cpu)[0] == 5
    # The default scores measurement candidates on every row (every source of the mix).
    assert _score_tokens(ConvertOptions(bits=4.0), cpu) is None
    assert _score_tokens(ConvertOptions(bits=4.0, fast=True), cpu) == SCORE_TOKENS_CPU


def test_domain_perplexities_are_each_texts_perplexity(tmp_path, capsys):
    path = tmp_path / "fp"
    make_tiny_llama(path)
    texts = domain_texts(["wiki", "multilingual"])
    model = loader.load(path, "kestrel", device="cpu", dtype="float32")
    got = domain_perplexities(model, texts, window=48, windows=2)
    for name, text in texts.items():
        want = text_perplexity(model, text, window=48, windows=2, add_bos=False)
        assert got[name] == pytest.approx(want, rel=1e-6)
    assert got["wiki"] != got["multilingual"]
    model.unload()
    main(["-m", str(path), "--domains", "code", "chat", "--window", "32", "--windows", "2",
          "--device", "cpu", "--loader", "kestrel"])  # fmt: skip
    table = capsys.readouterr().out
    assert "| model | code | chat |" in table
    row = next(line for line in table.splitlines() if line.startswith(f"| {path} |"))
    assert all(math.isfinite(float(v)) for v in row.strip("|").split("|")[1:])
    with pytest.raises(SystemExit, match="no held-out text for domain 'klingon'"):
        domain_texts(["klingon"])


def test_domain_windows_begin_with_bos_where_the_tokenizer_adds_one(tmp_path):
    # Gemma reads text after <bos> (its fp16 wiki perplexity is 11.5 with it, 19.2 without):
    # the domain tables score a model the way its tokenizer feeds it.
    path = tmp_path / "fp"
    make_tiny_llama(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    texts = domain_texts(["wiki"])
    model = loader.load(path, "kestrel", device="cpu", dtype="float32", max_seq_len=49)
    try:
        with_bos = text_perplexity(model, texts["wiki"], window=48, windows=2, add_bos=True)
        without = text_perplexity(model, texts["wiki"], window=48, windows=2, add_bos=False)
        assert with_bos != pytest.approx(without, rel=1e-3)
        got = domain_perplexities(model, texts, window=48, windows=2)["wiki"]
        assert got == pytest.approx(with_bos, rel=1e-6)
        forced = domain_perplexities(model, texts, window=48, windows=2, add_bos=False)["wiki"]
        assert forced == pytest.approx(without, rel=1e-6)
    finally:
        model.unload()


def test_heldout_readme_names_every_domain():
    readme = (Path(HELDOUT_DIR) / "README.md").read_text(encoding="utf-8")
    for domain in DOMAINS:
        assert f"| `{domain}` |" in readme
    data_readme = (cal.DATA_DIR / "README.md").read_text(encoding="utf-8")
    for name in cal.DEFAULT_SOURCES:
        assert f"| `{name}` |" in data_readme
