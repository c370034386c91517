"""Vocabulary-parallel embeddings and head (engine/tensor_parallel/vocab.py): two real gloo
ranks each keep half of the vocabulary's rows and still produce one process's logits,
greedy text and seeded samples, with a tied head over an odd vocabulary (the last rank's
slice is shorter) and with an EXL2-quantized head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import loader
from engine.quantized_linear import QuantizedLinear
from engine.tensor_parallel.errors import TensorParallelError
from engine.tensor_parallel.vocab import VocabParallelEmbedding, VocabParallelHead, vocab_range
from helpers.mixed_model import quantize_checkpoint
from helpers.model_factory import make_tiny_llama
from helpers.quantized import exl2_quantize

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ban_eos_token": True}
SEEDED = {"max_new_tokens": 12, "temperature": 1.0, "seed": 7, "ban_eos_token": True}


@pytest.mark.parametrize("vocab, world", [(384, 2), (387, 2), (387, 4), (5, 3), (128256, 8)])
def test_vocab_ranges_cover_the_vocabulary_once(vocab: int, world: int):
    ranges = [vocab_range(vocab, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == vocab
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    per_rank = -(-vocab // world)
    assert all(0 < hi - lo <= per_rank for lo, hi in ranges)


def test_a_vocabulary_too_small_for_the_ranks_is_refused():
    # 5 tokens over 4 ranks: 2 rows each leaves the last rank none.
    with pytest.raises(TensorParallelError, match="5 tokens leaves rank 3 of 4 no rows"):
        vocab_range(5, 3, 4)


def _ids(vocab: int) -> list[int]:
    # Ids from both ranks' slices, the last rows of the vocabulary included.
    ids = torch.randint(3, vocab, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    return [*ids, vocab - 1, vocab // 2, vocab // 2 - 1]


def _compare(path: Path, vocab: int) -> loader.LoadedModel:
    """Load `path` in one process and over two gloo ranks; check logits, greedy and seeded
    text agree; return the tensor-parallel model (the caller unloads it)."""
    ids = _ids(vocab)
    single = loader.load(path, "kestrel", device="cpu", dtype="float32")
    try:
        expected = single.logits(ids)
        greedy, seeded = single.generate(ids[:10], GREEDY), single.generate(ids[:10], SEEDED)
    finally:
        single.unload()
    assert expected.shape == (len(ids), vocab)
    tp = loader.load(path, "kestrel", device="cpu", dtype="float32", tp=2)
    try:
        logits = tp.logits(ids)
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
        assert tp.generate(ids[:10], GREEDY) == greedy
        assert tp.generate(ids[:10], SEEDED) == seeded
    except BaseException:
        tp.unload()
        raise
    return tp


def test_a_tied_head_over_an_odd_vocabulary_matches_one_process(tmp_path: Path):
    vocab = 387  # ranks keep 194 and 193 rows
    make_tiny_llama(tmp_path / "tied", tie_word_embeddings=True, vocab_size=vocab)
    tp = _compare(tmp_path / "tied", vocab)
    try:
        model = tp.engine.model
        embed, head = model.model.embed_tokens, model.lm_head
        assert isinstance(embed, VocabParallelEmbedding) and isinstance(head, VocabParallelHead)
        assert tuple(embed.weight.shape) == (194, 64) and embed.lo == 0  # rank 0's rows
        assert head.inner.weight is embed.weight  # still one tensor for both
        assert head.out_features == vocab
        # Each process's own count (rank 1 is another process), gathered once loaded.
        held = tp.info()["placement"]["rank_bytes"]
        assert [h["embed"] for h in held] == [194 * 64 * 4, 193 * 64 * 4]
        assert [h["head"] for h in held] == [0, 0]
    finally:
        tp.unload()


def test_a_quantized_head_is_cut_by_vocabulary_columns(tmp_path: Path):
    make_tiny_llama(tmp_path / "fp16", dtype=torch.float16)

    def head_only(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        return exl2_quantize(module, w.float()) if module == "lm_head" else ({"weight": w}, w)

    path = quantize_checkpoint(tmp_path / "fp16", tmp_path / "q", head_only)
    tp = _compare(path, 384)
    try:
        head = tp.engine.model.lm_head
        assert isinstance(head, VocabParallelHead) and isinstance(head.inner, QuantizedLinear)
        assert head.inner.format == "exl2" and head.inner.out_features == 192
        assert head.out_features == 384
    finally:
        tp.unload()
