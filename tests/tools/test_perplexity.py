"""tools/perplexity.py: the windowed perplexity equals a plain computation with
transformers, and the Kestrel and transformers loaders give the same number."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import loader
from helpers.model_factory import CORPUS, make_tiny_llama
from tools.perplexity import main, perplexity, text_windows

TEXT = " ".join(CORPUS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "fp"
    hf = make_tiny_llama(path)
    return path, hf


def _reference(hf, tokenizer, *, window: int, windows: int, start: float, bos: int | None):
    """exp(mean NLL) over the windows, straight from the HF model's logits."""
    ids = tokenizer(TEXT[int(len(TEXT) * start) :], add_special_tokens=False)["input_ids"]
    nll, count = 0.0, 0
    for w in range(windows):
        chunk = ([bos] if bos is not None else []) + ids[w * window : (w + 1) * window]
        with torch.no_grad():
            logits = hf(torch.tensor([chunk])).logits[0].float()
        nll += float(F.cross_entropy(logits[:-1], torch.tensor(chunk[1:]), reduction="sum"))
        count += len(chunk) - 1
    return math.exp(nll / count)


@pytest.mark.parametrize("add_bos", [False, True])
def test_perplexity_matches_plain_computation(tiny, add_bos):
    from transformers import AutoTokenizer

    path, hf = tiny
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = loader.load(path, "kestrel", device="cpu", dtype="float32")
    bos = model.backend.tokenizer.bos_token_id if add_bos else None
    got = perplexity(model, TEXT, window=48, windows=3, start_fraction=0.25, add_bos=add_bos)
    want = _reference(hf, tokenizer, window=48, windows=3, start=0.25, bos=bos)
    assert got == pytest.approx(want, rel=1e-4)


def test_kestrel_and_transformers_agree(tiny):
    path, _ = tiny
    values = [
        perplexity(
            loader.load(path, name, device="cpu", dtype="float32"),
            TEXT,
            window=64,
            windows=2,
            add_bos=False,
        )
        for name in ("kestrel", "transformers")
    ]
    assert values[0] == pytest.approx(values[1], rel=1e-4)


def test_windows_are_disjoint_and_bounded(tiny):
    path, _ = tiny
    model = loader.load(path, "kestrel", device="cpu")
    chunks = text_windows(model, TEXT, window=32, start_fraction=0.5)
    ids = model.encode(TEXT[len(TEXT) // 2 :], add_bos=False)
    assert sum(chunks, []) == ids[: len(chunks) * 32] and len(ids) - len(chunks) * 32 < 32
    with pytest.raises(ValueError, match="windows of 32 tokens"):
        text_windows(model, TEXT, window=32, windows=10_000)


def test_command_line(tiny, tmp_path, capsys):
    path, _ = tiny
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    args = ["-m", str(path), "--text", str(text), "--window", "40", "--windows", "2"]
    ppl = main([*args, "--no-bos", "--device", "cpu", "--loader", "kestrel"])
    assert math.isfinite(ppl) and "perplexity" in capsys.readouterr().out


@pytest.mark.parametrize("prefill_chunk", [2048, 16])
def test_kestrel_scores_tokens_where_its_logits_are(tiny, prefill_chunk):
    """The Kestrel loader's token_nll (scored on the model's device, piece by piece of the
    prefill) equals scoring logits() on the host: bit for bit in one piece, to float
    rounding over several (a window of 49 tokens in pieces of 16: max_batch also bounds a
    step's tokens from below)."""
    from loader.base import LoadedModel

    path, _ = tiny
    model = loader.load(
        path, "kestrel", device="cpu", dtype="float32", prefill_chunk=prefill_chunk, max_batch=1
    )
    ids = model.encode(TEXT, add_bos=False)[:49]
    got = model.token_nll(ids)
    want = LoadedModel.token_nll(model, ids)
    assert got[1] == want[1] == 48
    if prefill_chunk >= len(ids):
        assert got == want
    else:
        assert got[0] == pytest.approx(want[0], rel=1e-6)
