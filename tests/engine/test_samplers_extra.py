"""The TGW samplers beyond temperature/top_k/top_p/min_p, each against a reference.

References: transformers' own processors where they exist (typical_p, epsilon/eta cutoff,
no_repeat_ngram, logit bias, token bans, min_new_tokens); elsewhere a float64 loop over
plain Python lists written from the published definition (tfs, top_a, top_n_sigma, XTC,
DRY, quadratic sampling, dynamic temperature, mirostat 2). Random samplers get
distribution checks. Then sampler order, greedy decoding, an emptied row and (on a GPU)
the absence of host syncs. Parsing and validation of the new keys: tests/engine/test_sampling.py.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TypicalLogitsWarper,
)

from engine.sampling import (
    Sampler,
    apply_min_p,
    apply_presence_penalty,
    apply_repetition_penalty,
    apply_temperature,
    token_counts,
)

NEG_INF = float("-inf")


def _logits(rows: int = 4, vocab: int = 256, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def _context(rows: int, length: int, vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, length), generator=g)


def _process(settings: dict, logits: torch.Tensor, ctx=None, **kw) -> torch.Tensor:
    ctx = torch.empty(logits.shape[0], 0, dtype=torch.int64) if ctx is None else ctx
    return Sampler(settings, device=logits.device, **kw).process(logits, ctx)


def _same_distribution(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), "different -inf masks"
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1), atol=1e-6, rtol=0)


def _keep_mask(logits: torch.Tensor, keep) -> torch.Tensor:
    """Reference mask -> logits with the dropped tokens at -inf; keep(row) -> set of ids."""
    rows = logits.double().tolist()
    kept = [keep(row) for row in rows]
    drop = [[t not in k for t in range(len(row))] for row, k in zip(rows, kept, strict=True)]
    return logits.masked_fill(torch.tensor(drop, device=logits.device), NEG_INF)


def _probs64(row: list[float]) -> list[float]:
    top = max(row)
    e = [math.exp(x - top) if x != NEG_INF else 0.0 for x in row]
    return [x / sum(e) for x in e]


# --- against transformers -------------------------------------------------------------


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_typical_p_matches_hf(mass: float, device: str) -> None:
    logits = _logits().to(device)
    _same_distribution(
        _process({"typical_p": mass}, logits), TypicalLogitsWarper(mass)(None, logits)
    )


@pytest.mark.parametrize("cutoff", [1.0, 3.0, 9.0, 100.0])
def test_epsilon_and_eta_cutoff_match_hf_in_tgw_units(cutoff: float, device: str) -> None:
    logits = _logits(vocab=1024).to(device)
    eps = cutoff * 1e-4  # TGW's sliders are in units of 1e-4
    ours = _process({"epsilon_cutoff": cutoff}, logits)
    _same_distribution(ours, EpsilonLogitsWarper(eps)(None, logits.clone()))
    assert torch.isinf(ours).any()
    ours = _process({"eta_cutoff": cutoff}, logits)
    _same_distribution(ours, EtaLogitsWarper(eps, device=device)(None, logits.clone()))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_matches_hf(n: int, device: str) -> None:
    logits, ctx = _logits(6, 64).to(device), _context(6, 50, 5).to(device)
    ours = _process({"no_repeat_ngram_size": n}, logits, ctx)
    assert torch.equal(ours, NoRepeatNGramLogitsProcessor(n)(ctx, logits.clone()))
    # Left padding: each padded row equals the unpadded one.
    padded = torch.cat([torch.full((6, 7), -1, device=device), ctx[:, :30]], dim=1)
    ours = _process({"no_repeat_ngram_size": n}, logits, padded)
    ref = NoRepeatNGramLogitsProcessor(n)(ctx[:, :30], logits.clone())
    assert torch.equal(ours, ref)


def test_logit_bias_and_bans_match_hf(device: str) -> None:
    logits = _logits().to(device)
    bias = {"3": 2.5, 7: -1.25, "9": -100, 100000: 5.0}  # JSON keys are strings
    ours = _process({"logit_bias": bias}, logits)
    ref = SequenceBiasLogitsProcessor({(3,): 2.5, (7,): -1.25, (9,): -100.0})
    torch.testing.assert_close(ours, ref(torch.zeros(4, 1, dtype=torch.long), logits.clone()))
    ours = _process(
        {"custom_token_bans": "5, 17,200", "ban_eos_token": True}, logits, eos_token_ids=[2]
    )
    ref = SuppressTokensLogitsProcessor([5, 17, 200, 2], device=device)(None, logits.clone())
    assert torch.equal(ours, ref)


def test_min_new_tokens_matches_hf_and_counts_draws(device: str) -> None:
    logits, eos = _logits(2, 32).to(device), [4, 9]
    sampler = Sampler({"min_new_tokens": 3}, device=device, eos_token_ids=eos)
    hf = MinNewTokensLengthLogitsProcessor(5, 3, eos, device=device)
    for generated in range(6):
        ctx = torch.zeros(2, 5 + generated, dtype=torch.long, device=device)
        ours = sampler.process(logits, ctx, generated_count=generated)
        assert torch.equal(ours, hf(ctx, logits.clone()))
    # Per-row counts as a tensor, and the sampler's own counter.
    ours = sampler.process(logits, [[], []], generated_count=torch.tensor([1, 3], device=device))
    assert torch.isinf(ours[0, eos]).all() and not torch.isinf(ours[1]).any()
    peaked = torch.zeros(32, device=device)
    peaked[4] = 50.0
    greedy = Sampler({"min_new_tokens": 3, "do_sample": False}, device=device, eos_token_ids=eos)
    assert [greedy.sample(peaked, []) for _ in range(5)][2:] != [4, 4, 4]
    greedy = Sampler({"min_new_tokens": 3, "do_sample": False}, device=device, eos_token_ids=eos)
    assert [greedy.sample(peaked, []) == 4 for _ in range(5)] == [False] * 3 + [True] * 2


# --- against float64 references from the definitions ---------------------------------


@pytest.mark.parametrize("z", [0.0, 0.5, 0.95])
def test_tail_free_sampling(z: float) -> None:
    logits = _logits()

    def keep(row: list[float]) -> set[int]:
        order = sorted(range(len(row)), key=lambda t: -row[t])
        p = [_probs64(row)[t] for t in order]
        d2 = [abs(p[i] - 2 * p[i + 1] + p[i + 2]) for i in range(len(p) - 2)]
        cdf = [sum(d2[: i + 1]) / sum(d2) for i in range(len(d2))]
        return {order[0]} | {order[i + 1] for i, c in enumerate(cdf) if c <= z}

    _same_distribution(_process({"tfs": z}, logits), _keep_mask(logits, keep))


@pytest.mark.parametrize("a", [0.05, 0.2, 1.0])
def test_top_a(a: float) -> None:
    logits = _logits(scale=2.0)

    def keep(row: list[float]) -> set[int]:
        p = _probs64(row)
        return {t for t, q in enumerate(p) if q >= a * max(p) ** 2}

    _same_distribution(_process({"top_a": a}, logits), _keep_mask(logits, keep))


@pytest.mark.parametrize("n", [0.5, 1.0, 2.0])
def test_top_n_sigma_over_the_tokens_in_play(n: float) -> None:
    logits = _logits()
    logits[:, :40] = NEG_INF  # already masked: not part of the standard deviation

    def keep(row: list[float]) -> set[int]:
        finite = [x for x in row if x != NEG_INF]
        return {t for t, x in enumerate(row) if x >= max(finite) - n * statistics.stdev(finite)}

    _same_distribution(_process({"top_n_sigma": n}, logits), _keep_mask(logits, keep))


@pytest.mark.parametrize(("factor", "curve"), [(0.3, 1.0), (1.5, 2.5), (0.7, 4.0)])
def test_quadratic_sampling(factor: float, curve: float) -> None:
    logits = _logits()
    logits[0, :10] = NEG_INF
    ref = []
    for row in logits.double().tolist():
        m = max(row)
        k, s = (3 - curve) / 2, (curve - 1) / 2
        ref.append(
            [
                x if x == NEG_INF else m - k * factor * (x - m) ** 2 + s * factor * (x - m) ** 3
                for x in row
            ]
        )
    ours = _process({"smoothing_factor": factor, "smoothing_curve": curve}, logits)
    torch.testing.assert_close(ours, torch.tensor(ref, dtype=torch.float32), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize(
    ("low", "high", "exponent"), [(0.5, 1.5, 1.0), (0.2, 3.0, 0.5), (1.0, 1.0, 2.0)]
)
def test_dynamic_temperature(low: float, high: float, exponent: float) -> None:
    logits = _logits()
    logits[1, 5:] = NEG_INF  # H_max counts only the tokens in play
    logits[2, 1:] = NEG_INF  # one token left: TGW's guards give it `high`
    ref = []
    for row in logits.double().tolist():
        p = _probs64(row)
        h = max(-sum(q * math.log(q) for q in p if q > 0), 1e-10)
        h_max = math.log(sum(x != NEG_INF for x in row)) or 1e-10
        t = low + (high - low) * (h / h_max) ** exponent
        ref.append([x / t for x in row])
    settings = {
        "dynamic_temperature": True,
        "dynatemp_low": low,
        "dynatemp_high": high,
        "dynatemp_exponent": exponent,
    }
    ours = _process(settings, logits)
    torch.testing.assert_close(ours, torch.tensor(ref, dtype=torch.float32), rtol=1e-5, atol=1e-5)


def _xtc_keep(threshold: float, protected: set[int]):
    def keep(row: list[float]) -> set[int]:
        p = _probs64(row)
        above = [t for t, q in enumerate(p) if q >= threshold]
        drop = set(above) - {min(above, key=lambda t: p[t])} if len(above) >= 2 else set()
        return set(range(len(row))) if drop & protected else set(range(len(row))) - drop

    return keep


@pytest.mark.parametrize("threshold", [0.05, 0.1, 0.2])
def test_xtc_always_on_and_its_protected_tokens(threshold: float, device: str) -> None:
    logits = _logits(8, 64, scale=1.5).to(device)
    settings = {"xtc_probability": 1.0, "xtc_threshold": threshold}
    ref = _keep_mask(logits.cpu(), _xtc_keep(threshold, set())).to(device)
    _same_distribution(_process(settings, logits), ref)
    # Newline (found through `encode`) and EOS are never excluded: the row stays whole.
    top = int(logits[0].argmax())

    def encode(text: str) -> list[int]:
        return [1, top] if text == "\n" else [1]

    ours = _process(settings, logits, encode=encode, eos_token_ids=[int(logits[1].argmax())])
    ref = _keep_mask(logits.cpu(), _xtc_keep(threshold, {top, int(logits[1].argmax())}))
    _same_distribution(ours, ref.to(device))


def test_xtc_acts_with_its_probability() -> None:
    logits = torch.tensor([3.0, 2.9, 2.8, 0.0, -1.0]).expand(20000, -1)
    ours = _process({"xtc_probability": 0.3, "xtc_threshold": 0.1, "seed": 3}, logits)
    acted = torch.isinf(ours).any(-1).float().mean().item()
    assert abs(acted - 0.3) < 0.015
    assert torch.isinf(ours[:, :2]).all(-1).sum() == torch.isinf(ours).any(-1).sum()


def _dry_reference(
    ctx: list[int], vocab: int, mult: float, base: float, allowed: int, breakers: set[int]
) -> list[float]:
    """DRY from its definition: for each earlier occurrence of the last token, extend the
    match backwards (at most 50, not across breakers); penalize the token that followed."""
    penalty = [0.0] * vocab
    n = len(ctx)
    if n == 0 or ctx[-1] in breakers:
        return penalty
    longest: dict[int, int] = {}
    for i in range(n - 1):
        if ctx[i + 1] in breakers:
            continue
        m = 0
        while (
            m < 50
            and i - m >= 0
            and ctx[i - m] == ctx[n - 1 - m]
            and ctx[n - 1 - m] not in breakers
        ):
            m += 1
        if m:
            longest[ctx[i + 1]] = max(longest.get(ctx[i + 1], 0), m)
    for token, m in longest.items():
        if m >= allowed:
            penalty[token] = mult * base ** (m - allowed)
    return penalty


@pytest.mark.parametrize("allowed", [1, 2, 4])
def test_dry_matches_definition(allowed: int, device: str) -> None:
    vocab, mult, base = 40, 0.8, 1.75
    g = torch.Generator().manual_seed(7)

    def rand(n: int, lo: int = 6, hi: int = vocab) -> list[int]:
        return torch.randint(lo, hi, (n,), generator=g).tolist()

    phrase, noise = rand(12), rand(9)
    broken = phrase[:4] + [3] + phrase[5:]  # a breaker (3) inside the phrase
    rows = [
        (phrase + noise) * 3 + phrase[:5],  # whole blocks repeat: matches hit the cap
        (broken + noise) * 3 + broken[:8],  # matches stop at the breaker
        (phrase + noise) * 2 + [5],  # the last token is a breaker: no penalty
        rand(80, 0, 7),  # short random repeats, breakers among them
        ([9, 10, 11, 5] + rand(5)) * 3 + [9, 10, 11],  # what follows is a breaker
        list(range(6, 36)) * 3,  # one match longer than 50
    ]
    width = max(map(len, rows)) + 3
    ctx = torch.tensor([[-1] * (width - len(r)) + r for r in rows], device=device)
    # Breakers as TGW finds them: the last id of "a" + breaker.
    ids = {"a\n": [0, 3], "a:": [0, 5]}
    settings = {
        "dry_multiplier": mult,
        "dry_base": base,
        "dry_allowed_length": allowed,
        "dry_sequence_breakers": '"\\n", ":"',
    }
    logits = _logits(len(rows), vocab).to(device)
    ours = _process(settings, logits, ctx, encode=lambda s: ids.get(s, [0]))
    ref = torch.tensor(
        [_dry_reference(r, vocab, mult, base, allowed, {3, 5}) for r in rows], device=device
    )
    assert ref[0].max() > 1e6 and ref[5].max() > 1e6  # the cap at 50 is reached
    assert ref[2].max() == ref[4].max() == 0  # breakers at the end and after the match
    torch.testing.assert_close(logits - ours, ref, rtol=1e-5, atol=1e-5)


class _CountOps(TorchDispatchMode):
    """Counts the tensor operations run under it (each aten call once)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _dry_ops(settings: dict, ctx: list[int]) -> list[str]:
    sampler = Sampler(settings)
    logits = torch.zeros(1, 512)
    with _CountOps() as counter:
        sampler.process(logits, torch.tensor([ctx]))
    return counter.ops


def test_dry_range_and_8k_context() -> None:
    g = torch.Generator().manual_seed(3)
    phrase = torch.randint(0, 500, (40,), generator=g).tolist()
    ctx = torch.randint(0, 500, (8192,), generator=g).tolist()
    ctx[1000:1040] = phrase
    ctx[-30:] = phrase[:30]
    logits = torch.zeros(1, 512)
    settings = {"dry_multiplier": 1.0, "dry_base": 1.5, "dry_sequence_breakers": ""}
    whole = {**settings, "repetition_penalty_range": 0}
    ours = Sampler(whole).process(logits, torch.tensor([ctx]))
    ref = _dry_reference(ctx, 512, 1.0, 1.5, 2, set())
    torch.testing.assert_close(
        -ours[0], torch.tensor(ref, dtype=torch.float32), rtol=1e-5, atol=1e-5
    )
    assert -ours[0, phrase[30]] == pytest.approx(1.5**28, rel=1e-5)
    # The range: dry_penalty_last_n, else repetition_penalty_range (TGW; 1024 by default).
    for extra, last in (
        ({"dry_penalty_last_n": 5000}, 5000),
        ({"repetition_penalty_range": 5000}, 5000),
        ({}, 1024),
    ):
        cut = Sampler({**settings, **extra}).process(logits, torch.tensor([ctx]))
        assert torch.equal(
            cut, -torch.tensor([_dry_reference(ctx[-last:], 512, 1.0, 1.5, 2, set())])
        )
        assert cut[0, phrase[30]] == 0
    # Work, counted in tensor operations rather than seconds (a busy machine changes the
    # seconds): the same operations whatever the context length, so no Python loop runs
    # over the context's positions or matches, and no value is read back to the host.
    short, long = _dry_ops(whole, ctx[-1024:]), _dry_ops(whole, ctx)
    assert short == long
    assert not [op for op in long if "_local_scalar_dense" in op or "nonzero" in op]


def test_mirostat_truncation_and_update(device: str) -> None:
    logits = _logits(3, 128).to(device)
    tau, eta = 3.0, 0.2
    sampler = Sampler(
        {"mirostat_mode": 2, "mirostat_tau": tau, "mirostat_eta": eta, "seed": 1}, device=device
    )

    def keep(row: list[float]) -> set[int]:
        p = _probs64(row)
        top = max(range(len(p)), key=lambda t: p[t])
        return {top} | {t for t, q in enumerate(p) if q > 0 and -math.log2(q) <= 2 * tau}

    ref = _keep_mask(logits.cpu(), keep).to(device)
    _same_distribution(sampler.process(logits, torch.empty(3, 0, dtype=torch.long)), ref)
    tokens, scores = sampler.sample_with_scores(logits, torch.empty(3, 0, dtype=torch.long))
    surprise = -torch.log2(ref.double().softmax(-1).gather(-1, tokens[:, None].cpu().to(device)))[
        :, 0
    ]
    torch.testing.assert_close(
        sampler.mirostat_mu.double(), 2 * tau - eta * (surprise - tau), rtol=0, atol=1e-5
    )


def test_mirostat_surprise_trends_to_tau() -> None:
    ranks = torch.arange(1, 501, dtype=torch.float32)
    logits = (-1.1 * ranks.log()).expand(32, -1).contiguous()  # Zipf, as text roughly is
    tau = 3.0
    sampler = Sampler({"mirostat_mode": 2, "mirostat_tau": tau, "mirostat_eta": 0.1, "seed": 5})
    ctx = torch.empty(32, 0, dtype=torch.long)
    surprises = []
    for _ in range(200):
        tokens, scores = sampler.sample_with_scores(logits, ctx)
        # The surprise mirostat steers: under its truncated distribution, in bits.
        surprises.append(-torch.log2(scores.softmax(-1).gather(-1, tokens[:, None])).mean())
    late = torch.stack(surprises[80:]).mean().item()
    assert abs(late - tau) < 0.2, late
    # Without mirostat the same distribution is far more surprising than the target.
    p = logits[0].softmax(-1)
    assert -(p * p.log2()).sum() > tau + 1


# --- order, greedy, fallback, syncs -------------------------------------------------


def test_sampler_priority_decides_the_order() -> None:
    logits = _logits()
    base = {"temperature": 2.0, "min_p": 0.2}
    a = _process({**base, "sampler_priority": "min_p\ntemperature"}, logits)
    b = _process({**base, "sampler_priority": ["temperature", "min_p"]}, logits)
    _same_distribution(a, apply_temperature(apply_min_p(logits, 0.2), 2.0))
    _same_distribution(b, apply_min_p(apply_temperature(logits, 2.0), 0.2))
    assert not torch.equal(torch.isinf(a), torch.isinf(b))
    # Samplers missing from the list run first, as in TGW: min_p before temperature here.
    _same_distribution(_process({**base, "sampler_priority": "temperature"}, logits), a)
    ctx = _context(4, 30, 256)
    counts = token_counts(ctx, 256)
    pen = {"repetition_penalty": 1.3, "presence_penalty": 0.7}
    first = _process(
        {**pen, "sampler_priority": "presence_penalty,repetition_penalty"}, logits, ctx
    )
    ref = apply_repetition_penalty(apply_presence_penalty(logits, counts, 0.7), counts, 1.3)
    torch.testing.assert_close(first, ref)
    assert not torch.allclose(first, _process(pen, logits, ctx))


def test_greedy_applies_penalties_not_warpers() -> None:
    logits = torch.tensor([0.0, 1.0, 5.0, 4.9, 4.0])
    ctx = [1, 2, 3, 1, 2]  # "1 2" came before 3 and is at the end again: DRY hits 3
    assert Sampler({"do_sample": False}).sample(logits, ctx) == 2
    assert (
        Sampler({"do_sample": False, "no_repeat_ngram_size": 2}).sample(logits, [1, 2, 3, 1]) == 3
    )
    dry = {"do_sample": False, "dry_multiplier": 1.0, "dry_sequence_breakers": ""}
    assert Sampler(dry).sample(torch.tensor([0.0, 1.0, 4.0, 4.9, 4.0]), ctx) == 2
    # XTC would drop 2 and 3; greedy skips it like the other warpers.
    assert Sampler({"do_sample": False, "xtc_probability": 1.0}).sample(logits, []) == 2


def test_emptied_row_falls_back_to_best_allowed_token() -> None:
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0])
    s = {"top_k": 1, "no_repeat_ngram_size": 1, "custom_token_bans": "1"}
    assert Sampler(s).sample(logits, [2]) == 2  # top_k keeps 2, the n-gram ban removes it


@pytest.mark.gpu
def test_no_host_sync_per_step() -> None:
    settings = {
        "repetition_penalty": 1.1,
        "presence_penalty": 0.2,
        "dry_multiplier": 0.8,
        "top_n_sigma": 2.0,
        "dynamic_temperature": True,
        "dynatemp_low": 0.5,
        "dynatemp_high": 1.5,
        "smoothing_factor": 0.3,
        "top_k": 50,
        "top_p": 0.95,
        "typical_p": 0.9,
        "epsilon_cutoff": 3,
        "eta_cutoff": 3,
        "tfs": 0.95,
        "top_a": 0.1,
        "min_p": 0.05,
        "xtc_probability": 0.5,
        "no_repeat_ngram_size": 3,
        "logit_bias": {"3": 1.0},
        "custom_token_bans": "7",
        "min_new_tokens": 2,
    }
    logits, ctx = _logits(2, 32000).cuda(), _context(2, 4096, 32000).cuda()
    for extra in ({}, {"mirostat_mode": 2}):
        sampler = Sampler(
            {**settings, **extra}, device="cuda", eos_token_ids=[2], encode=lambda s: [1, 5]
        )
        sampler.sample_batch(logits, ctx)  # the first call builds the per-vocabulary tensors
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                sampler.sample_batch(logits, ctx)
        finally:
            torch.cuda.set_sync_debug_mode("default")
