"""Batched sampling (engine/samplers/batched.py): rows with different temperature, top_k,
top_p, min_p, bias and bans drawn together must give exactly the tokens each row's own
Sampler gives (same seeds), step after step; other settings stay on the per-row path."""

from __future__ import annotations

import pytest
import torch

from engine.generator import JobSampler, sample_jobs
from engine.samplers.batched import batchable, sample_batched
from engine.sampling import Sampler, SamplingSettings
from engine.tokenizer import Tokenizer
from helpers.model_factory import write_tokenizer

VOCAB = 97
EOS = 5

ROW_SETTINGS = [
    {"temperature": 0.7, "seed": 1},
    {"temperature": 1.3, "top_k": 5, "seed": 2},
    {"top_p": 0.8, "seed": 3},
    {"min_p": 0.1, "temperature": 1.5, "seed": 4},
    {"temperature": 2.0, "top_k": 20, "top_p": 0.9, "min_p": 0.02, "seed": 5},
    {"temperature": 2.0, "min_p": 0.2, "temperature_last": True, "seed": 6},
    {"top_k": 3, "logit_bias": {7: 4.0, 8: -50.0}, "custom_token_bans": [9, 10], "seed": 7},
    {"temperature": 0.9, "min_new_tokens": 2, "seed": 8},
    {"seed": 9},  # plain softmax sampling
    # Greedy rows with only a bias, bans or min_new_tokens: argmax after those, no noise.
    {"temperature": 0, "ban_eos_token": True},
    {"temperature": 0, "logit_bias": {11: 3.0}, "custom_token_bans": [12]},
    {"temperature": 0, "min_new_tokens": 3},
]
GREEDY_ROWS = ROW_SETTINGS[-3:]


def _samplers(settings: list[dict]) -> list[Sampler]:
    return [Sampler(s, eos_token_ids=[EOS]) for s in settings]


def test_batched_rows_equal_their_own_samplers():
    batched, reference = _samplers(ROW_SETTINGS), _samplers(ROW_SETTINGS)
    assert all(batchable(s) for s in batched)
    gen = torch.Generator().manual_seed(0)
    empty = torch.empty(1, 0, dtype=torch.int64)
    seen = set()
    for _ in range(12):
        logits = torch.randn(len(ROW_SETTINGS), VOCAB, generator=gen) * 3
        logits[:, EOS] += 6  # EOS likely, so min_new_tokens matters
        got = sample_batched(batched, logits)
        expected = torch.cat(
            [s.sample_batch(logits[i : i + 1], empty) for i, s in enumerate(reference)]
        )
        assert got.tolist() == expected.tolist()
        seen.update(got.tolist())
    assert len(seen) > 10  # random draws, not a fixed argmax
    assert [s.generated for s in batched] == [12] * len(ROW_SETTINGS)


def test_greedy_rows_alone_take_the_argmax_after_bias_and_bans():
    batched, reference = _samplers(GREEDY_ROWS), _samplers(GREEDY_ROWS)
    gen = torch.Generator().manual_seed(2)
    empty = torch.empty(1, 0, dtype=torch.int64)
    for step in range(5):
        logits = torch.randn(len(GREEDY_ROWS), VOCAB, generator=gen)
        logits[:, EOS] += 10  # the raw argmax is EOS: the bans and min_new_tokens decide
        logits[1, 12] += 20  # banned for row 1
        got = sample_batched(batched, logits)
        expected = torch.cat(
            [s.sample_batch(logits[i : i + 1], empty) for i, s in enumerate(reference)]
        )
        assert got.tolist() == expected.tolist()
        assert got[0] != EOS and got[1] != 12
        assert (got[2] == EOS) == (step >= 3)  # min_new_tokens=3 holds EOS back 3 steps


def test_only_the_covered_settings_are_batched():
    assert batchable(Sampler({"temperature": 0, "ban_eos_token": True}))
    assert not batchable(Sampler({"temperature": 0, "repetition_penalty": 1.2}))
    assert not batchable(Sampler({"temperature": 0, "no_repeat_ngram_size": 2}))
    assert not batchable(Sampler({"dry_multiplier": 0.8, "dry_sequence_breakers": []}))
    assert not batchable(Sampler({"mirostat_mode": 2}))
    assert not batchable(Sampler({"repetition_penalty": 1.2}))
    assert not batchable(Sampler({"typical_p": 0.9}))
    # an order the batched path does not follow (min_p before top_k)
    custom = {"top_k": 5, "min_p": 0.1, "sampler_priority": ["min_p", "top_k", "temperature"]}
    assert not batchable(Sampler(custom))
    assert batchable(Sampler({"top_k": 5, "min_p": 0.1}))


@pytest.mark.parametrize("rows", [1, 3])
def test_sample_jobs_mixes_paths(rows: int, tmp_path):
    # The generator's sample_jobs sends batchable rows together and the rest per row; the
    # tokens must not depend on how the batch is split.
    write_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    settings = [
        {"temperature": 0.8, "top_k": 10, "seed": 1},
        {"repetition_penalty": 1.3, "temperature": 0.9, "seed": 2},
        {"temperature": 0},
        {"min_p": 0.05, "seed": 3},
        {"temperature": 0, "ban_eos_token": True, "logit_bias": {20: 2.0}},
    ][: rows + 2]
    settings = [SamplingSettings.from_any(s) for s in settings]
    prompt = [11, 12, 13]
    gen = torch.Generator().manual_seed(1)
    together = [JobSampler(s, tok, torch.device("cpu"), prompt, 8) for s in settings]
    alone = [JobSampler(s, tok, torch.device("cpu"), prompt, 8) for s in settings]
    for _ in range(4):
        logits = torch.randn(len(settings), 384, generator=gen) * 2
        tokens, _ = sample_jobs(together, logits)
        each = [sample_jobs([j], logits[i : i + 1])[0][0] for i, j in enumerate(alone)]
        assert tokens == each


@pytest.mark.gpu
def test_batched_on_gpu_matches_rows_without_a_host_sync():
    def make() -> list[Sampler]:
        return [Sampler(s, device="cuda", eos_token_ids=[EOS]) for s in ROW_SETTINGS]

    batched, reference = make(), make()
    gen = torch.Generator().manual_seed(0)
    empty = torch.empty(1, 0, dtype=torch.int64, device="cuda")
    for step in range(4):
        logits = (torch.randn(len(ROW_SETTINGS), VOCAB, generator=gen) * 3).cuda()
        if step:  # the first call builds the per-vocabulary tensors
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = sample_batched(batched, logits)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        expected = torch.cat(
            [s.sample_batch(logits[i : i + 1], empty) for i, s in enumerate(reference)]
        )
        assert got.tolist() == expected.tolist()
