"""Speculative decoding (engine/speculative.py) on tiny random Llamas, on the CPU.

Greedy output must be identical with and without speculation (n-gram drafts, a smaller
draft model, and the target as its own draft, which must accept every draft); the
acceptance rule must leave the target's distribution exactly as it is (checked by counts
on fixed distributions).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import loader
from engine.engine import Engine, EngineOptions
from engine.speculative import NgramDrafter, accept
from helpers.model_factory import make_tiny_llama

GREEDY = {"temperature": 0, "ban_eos_token": True}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec-target")
    make_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Same vocabulary and tokenizer, other shape and weights.
    path = tmp_path_factory.mktemp("spec-draft")
    make_tiny_llama(
        path,
        seed=7,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return path


def _engine(path: Path, **options) -> Engine:
    base = dict(
        device="cpu",
        dtype="float32",
        max_seq_len=256,
        page_size=8,
        cache_tokens=1024,
        prefill_chunk=32,
        max_batch=8,
    )
    return Engine.load(path, EngineOptions(**{**base, **options}))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


# A prompt that repeats itself, so prompt lookup finds continuations; and plain ones.
REPEATING = _prompt(12, seed=1) * 4
PROMPTS = [REPEATING, _prompt(9, seed=2), _prompt(23, seed=3), _prompt(5, seed=4)]


def _run(engine: Engine, prompts: list[list[int]], settings: dict | list[dict]) -> list[list[int]]:
    each = settings if isinstance(settings, list) else [settings] * len(prompts)
    jobs = [engine.scheduler.submit(p, s) for p, s in zip(prompts, each, strict=True)]
    out: dict[int, list[int]] = {job.id: [] for job in jobs}
    for event in engine.scheduler.stream_many(jobs):
        out[event.job_id] += event.token_ids
    assert all(job.finish_reason == "length" for job in jobs)
    return [out[job.id] for job in jobs]


@pytest.fixture(scope="module")
def reference(target_dir: Path) -> list[list[int]]:
    return _run(_engine(target_dir), PROMPTS, {**GREEDY, "max_new_tokens": 24})


def test_ngram_greedy_identical_single_and_batched(target_dir: Path, reference):
    engine = _engine(target_dir, speculative="ngram", num_draft_tokens=4)
    settings = {**GREEDY, "max_new_tokens": 24}
    assert _run(engine, PROMPTS[:1], settings) == reference[:1]
    single = engine.scheduler.stats()
    # the repeating prompt gets drafts, and some stand
    assert single["draft_tokens"] > 0 and single["accepted_tokens"] > 0
    assert single["tokens_per_step"] > 1.0
    free = engine.cache.free_pages
    assert _run(engine, PROMPTS, settings) == reference
    assert engine.cache.free_pages == free


def test_draft_model_greedy_identical(target_dir: Path, small_dir: Path, reference):
    engine = _engine(target_dir, draft_model=str(small_dir), num_draft_tokens=2)
    assert engine.scheduler.speculative == "draft"
    assert _run(engine, PROMPTS, {**GREEDY, "max_new_tokens": 24}) == reference
    stats = engine.scheduler.stats()
    assert stats["draft_tokens"] > 0 and 0.0 <= stats["acceptance_rate"] <= 1.0
    draft_cache = engine.draft_engine.cache
    assert draft_cache.free_pages == draft_cache.num_pages  # every job's draft pages freed


def test_target_as_its_own_draft_accepts_everything(target_dir: Path, reference):
    engine = _engine(target_dir, speculative="draft", draft_model=str(target_dir))
    assert _run(engine, PROMPTS, {**GREEDY, "max_new_tokens": 24}) == reference
    stats = engine.scheduler.stats()
    assert stats["draft_tokens"] > 0 and stats["acceptance_rate"] == 1.0
    # 4 drafts + 1 per verify step, less where max_new_tokens cut the drafts short
    assert stats["tokens_per_step"] > 3.0


def test_no_drafts_above_speculative_max_batch(target_dir: Path, reference):
    engine = _engine(
        target_dir, draft_model=str(target_dir), speculative_max_batch=1, num_draft_tokens=2
    )
    # both prompts prefill in the first step and then decode side by side to the end
    got = _run(engine, [PROMPTS[1], PROMPTS[3]], {**GREEDY, "max_new_tokens": 24})
    assert got == [reference[1], reference[3]]
    assert engine.scheduler.stats()["draft_tokens"] == 0
    assert _run(engine, [PROMPTS[1]], {**GREEDY, "max_new_tokens": 24}) == [reference[1]]
    assert engine.scheduler.stats()["draft_tokens"] > 0


def test_greedy_with_penalties_and_logprobs(target_dir: Path):
    # Penalties see the drafts before each position: still identical to plain decoding.
    settings = {
        **GREEDY,
        "max_new_tokens": 20,
        "repetition_penalty": 1.3,
        "logprobs": 2,
    }
    plain = _engine(target_dir)
    spec = _engine(target_dir, speculative="draft", draft_model=str(target_dir))
    ref_job = plain.scheduler.submit(REPEATING, settings)
    ref = list(plain.scheduler.stream(ref_job))
    job = spec.scheduler.submit(REPEATING, settings)
    got = list(spec.scheduler.stream(job))
    assert job.generated_ids == ref_job.generated_ids
    ref_lp = [lp for e in ref for lp in e.logprobs]
    got_lp = [lp for e in got for lp in e.logprobs]
    assert [lp.token_id for lp in got_lp] == job.generated_ids
    for a, b in zip(got_lp, ref_lp, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    # the draft proposes the raw argmax; the penalty makes the target reject some
    assert job.draft_tokens > 0


def test_seeded_sampling_is_repeatable(target_dir: Path, reference):
    settings = {"max_new_tokens": 10, "temperature": 0.8, "top_k": 50, "seed": 5}
    runs = []
    for _ in range(2):
        engine = _engine(target_dir, draft_model=str(target_dir), num_draft_tokens=2)
        runs.append(_run(engine, PROMPTS[:1], settings))
        assert engine.scheduler.stats()["draft_tokens"] > 0
    assert runs[0] == runs[1] and len(runs[0][0]) == 10
    assert runs[0][0] != reference[0][:10]  # sampled, not the greedy tokens


def test_ngram_drafter_lookup_and_rewind():
    drafter = NgramDrafter(max_n=3, min_n=1)
    tokens = [5, 6, 7, 8, 9, 5, 6, 7]
    assert drafter.propose(tokens, 3) == [8, 9, 5]  # "5 6 7" seen before, followed by 8 9 5
    assert drafter.propose([1, 2, 3], 2) == []  # no earlier occurrence
    drafter = NgramDrafter(max_n=2, min_n=1)
    drafter.propose(tokens, 2)
    drafter.rewind(4)  # the context is now [5, 6, 7, 8] and grows differently
    assert drafter.propose([5, 6, 7, 8, 6], 2) == [7, 8]


def test_options_and_errors(target_dir: Path, small_dir: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="speculative must be one of ngram, draft"):
        _engine(target_dir, speculative="medusa")
    with pytest.raises(ValueError, match="needs draft_model"):
        _engine(target_dir, speculative="draft")
    other = tmp_path / "other-vocab"
    make_tiny_llama(other, seed=3, vocab_size=320, num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocabulary of 320 tokens, the target 384"):
        _engine(target_dir, draft_model=str(other))
    m = loader.load(
        target_dir, "kestrel", device="cpu", dtype="float32", speculative="ngram", page_size=8
    )
    info = m.info()["scheduler"]
    assert info["speculative"] == "ngram" and info["num_draft_tokens"] == 4
    text = m.generate(REPEATING, {**GREEDY, "max_new_tokens": 8})
    assert isinstance(text, str) and m.info()["scheduler"]["draft_tokens"] >= 0
    m.unload()


def _first_token_counts(
    probs: torch.Tensor, draft_probs: torch.Tensor | None, trials: int, seed: int
) -> torch.Tensor:
    """How often each token comes out first from `accept` over many independent trials."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(probs.shape[-1])
    k = probs.shape[0] - 1
    for _ in range(trials):
        if draft_probs is None:
            drafts = torch.tensor([2] * k)  # a fixed guess: q is a point mass on it
        else:
            drafts = torch.multinomial(draft_probs, 1, generator=generator).view(-1)
        accepted, token = accept(probs, drafts, generator, draft_probs)
        first = drafts[0] if accepted > 0 else token
        counts[first] += 1
    return counts / trials


@pytest.mark.parametrize("point_mass", [True, False])
def test_acceptance_rule_keeps_the_target_distribution(point_mass: bool):
    gen = torch.Generator().manual_seed(0)
    vocab, k, trials = 6, 3, 6000
    probs = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, dim=-1)
    draft_probs = None if point_mass else torch.softmax(torch.randn(k, vocab, generator=gen), -1)
    empirical = _first_token_counts(probs, draft_probs, trials, seed=1)
    # 6000 draws: the standard error of a frequency is <= 0.0065; 4 sigma is 0.026
    assert (empirical - probs[0]).abs().max() < 0.026
    # and it is not simply the draft distribution
    if draft_probs is not None:
        assert (empirical - draft_probs[0]).abs().max() > 0.05


@pytest.mark.gpu
def test_gpu_greedy_identical_with_cuda_graphs(target_dir: Path, small_dir: Path):
    settings = {**GREEDY, "max_new_tokens": 32}
    gpu = {"device": "cuda", "dtype": "float16"}
    plain = _engine(target_dir, **gpu)
    assert plain.graphs is not None
    reference = _run(plain, PROMPTS, settings)
    plain.unload()
    for spec in (
        {"speculative": "ngram"},
        {"draft_model": str(small_dir)},
        {"draft_model": str(target_dir)},
    ):
        engine = _engine(target_dir, **gpu, **spec)
        assert _run(engine, PROMPTS, settings) == reference, spec
        assert engine.scheduler.stats()["draft_tokens"] > 0
        engine.unload()


def test_passthrough_target_and_its_exact_draft(tmp_path: Path):
    # The construction tools/bench_speculative.py measures on a GPU: later layers with
    # zeroed output projections add nothing, so the first layers predict the target exactly.
    from tools.bench_speculative import make_passthrough_pair

    target, draft = tmp_path / "target", tmp_path / "draft"
    make_tiny_llama(target, seed=5, num_hidden_layers=3)
    make_passthrough_pair(target, draft, draft_layers=1)
    settings = {**GREEDY, "max_new_tokens": 12}
    prompts = PROMPTS[1:3]
    reference = _run(_engine(target), prompts, settings)
    assert _run(_engine(draft), prompts, settings) == reference
    engine = _engine(target, draft_model=str(draft), num_draft_tokens=4)
    assert _run(engine, prompts, settings) == reference
    assert engine.scheduler.stats()["acceptance_rate"] == 1.0
