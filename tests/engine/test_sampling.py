"""Sampler steps against transformers' logits processors, draws against their distribution,
and SamplingSettings parsing of TGW-style state (every key's validation included)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sampling import (
    Sampler,
    SamplingSettings,
    SamplingSettingsError,
    apply_presence_frequency_penalty,
    sampler_order,
    token_counts,
)

VOCAB = 64


def _logits(rows: int = 4, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def _context(rows: int = 4, length: int = 40, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    # A small id range makes repeats certain, so counts above 1 are exercised.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab // 4, (rows, length), generator=g)


def _assert_same_distribution(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), "different -inf masks"
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1), atol=1e-6, rtol=0)


def _process(settings: dict, logits: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
    return Sampler(settings, device=logits.device).process(logits, ctx)


@pytest.mark.parametrize("penalty", [1.3, 0.8])
@pytest.mark.parametrize("rep_range", [0, 7])
def test_repetition_penalty_matches_hf(penalty: float, rep_range: int, device: str) -> None:
    logits, ctx = _logits().to(device), _context().to(device)
    ours = _process(
        {"repetition_penalty": penalty, "repetition_penalty_range": rep_range}, logits, ctx
    )
    hf_ctx = ctx[:, -rep_range:] if rep_range else ctx
    ref = RepetitionPenaltyLogitsProcessor(penalty)(hf_ctx, logits.clone())
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    assert not torch.equal(ours, logits)


def test_presence_frequency_penalty_matches_openai_formula(device: str) -> None:
    logits, ctx = _logits().to(device), _context().to(device)
    ours = _process(
        {"presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty_range": 10},
        logits,
        ctx,
    )
    ref = logits.clone()
    for row in range(ctx.shape[0]):
        recent = ctx[row, -10:].tolist()
        for token in set(recent):
            ref[row, token] -= 0.5 + 0.25 * recent.count(token)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


def test_token_counts_ignores_padding_and_out_of_range_ids() -> None:
    ctx = torch.tensor([[-1, -1, 3, 3, 9], [2, 100, 2, 2, 0]])
    counts = token_counts(ctx, vocab_size=10)
    assert counts[0].tolist() == [0, 0, 0, 2, 0, 0, 0, 0, 0, 1]
    assert counts[1].tolist() == [1, 0, 3] + [0] * 7
    assert token_counts(ctx, 10, last_n=2)[1].tolist() == [1, 0, 1] + [0] * 7
    out = apply_presence_frequency_penalty(torch.zeros(2, 10), counts, 1.0, 0.5)
    assert out[0].tolist() == [0, 0, 0, -2, 0, 0, 0, 0, 0, -1.5]


@pytest.mark.parametrize(
    ("settings", "hf"),
    [
        ({"temperature": 0.7}, TemperatureLogitsWarper(0.7)),
        ({"top_k": 5}, TopKLogitsWarper(5)),
        ({"top_k": 1000}, TopKLogitsWarper(1000)),
        ({"top_p": 0.9}, TopPLogitsWarper(0.9)),
        ({"top_p": 0.3}, TopPLogitsWarper(0.3)),
        ({"top_p": 1e-6}, TopPLogitsWarper(1e-6)),
        ({"min_p": 0.05}, MinPLogitsWarper(0.05)),
        ({"min_p": 0.5}, MinPLogitsWarper(0.5)),
        ({"min_p": 1.0}, MinPLogitsWarper(1.0)),
    ],
    ids=lambda x: str(x) if isinstance(x, dict) else "",
)
def test_warper_matches_hf(settings: dict, hf: LogitsProcessor, device: str) -> None:
    logits, ctx = _logits().to(device), _context().to(device)
    ours = _process(settings, logits, ctx)
    ref = hf(ctx, logits.clone())
    _assert_same_distribution(ours, ref)


@pytest.mark.parametrize("temperature_last", [False, True])
def test_full_chain_matches_hf(temperature_last: bool, device: str) -> None:
    logits, ctx = _logits(rows=6, vocab=256).to(device), _context(6, 80, 256).to(device)
    settings = {
        "temperature": 1.6,
        "top_k": 40,
        "top_p": 0.8,
        "min_p": 0.1,
        "repetition_penalty": 1.15,
        "temperature_last": temperature_last,
    }
    warpers = [TopKLogitsWarper(40), TopPLogitsWarper(0.8), MinPLogitsWarper(0.1)]
    temperature = TemperatureLogitsWarper(1.6)
    warpers = [*warpers, temperature] if temperature_last else [temperature, *warpers]
    chain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.15), *warpers])
    _assert_same_distribution(_process(settings, logits, ctx), chain(ctx, logits.clone()))


@pytest.mark.parametrize("one_call", [True, False], ids=["sample_batch", "sample"])
def test_draws_follow_softmax_of_logits_over_temperature(one_call: bool) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    sampler = Sampler({"temperature": 0.8, "seed": 1234})
    n = 20000
    if one_call:
        draws = sampler.sample_batch(logits.expand(n, -1), torch.empty(n, 0, dtype=torch.int64))
    else:
        # One call per token, as in decoding: the generator must advance between calls.
        draws = torch.tensor([sampler.sample(logits, []) for _ in range(n)])
    freq = torch.bincount(draws, minlength=8).float() / n
    expected = (logits / 0.8).softmax(-1)
    assert (freq - expected).abs().max() < 0.02


def test_draws_never_leave_the_filtered_set() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    sampler = Sampler({"top_k": 3, "seed": 5})
    n = 20000
    draws = sampler.sample_batch(logits.expand(n, -1), torch.empty(n, 0, dtype=torch.int64))
    freq = torch.bincount(draws, minlength=8).float() / n
    kept = torch.tensor([0, 1, 6])
    expected = torch.zeros(8)
    expected[kept] = logits[kept].softmax(-1)
    assert set(draws.unique().tolist()) == set(kept.tolist())
    assert (freq - expected).abs().max() < 0.02


def test_same_seed_same_sequence_and_random_seed_is_reported(device: str) -> None:
    logits = _logits(rows=1)[0].to(device)

    def run(seed: int) -> tuple[int, list[int]]:
        sampler = Sampler({"seed": seed, "temperature": 1.5}, device=device)
        return sampler.seed, [sampler.sample(logits, [1, 2, 3]) for _ in range(50)]

    assert run(42) == run(42)
    assert run(42)[1] != run(43)[1]
    seed, tokens = run(-1)
    assert 0 <= seed < 2**31
    assert run(seed) == (seed, tokens)


def test_greedy_takes_argmax_after_penalties(device: str) -> None:
    logits = torch.tensor([1.0, 3.0, 2.9, -1.0], device=device)
    for settings in ({"do_sample": False}, {"temperature": 0}):
        assert Sampler(settings, device=device).sample(logits, []) == 1
        penalized = {**settings, "repetition_penalty": 1.5, "top_k": 1}
        assert Sampler(penalized, device=device).sample(logits, [1, 1]) == 2
    # Greedy ignores the warpers: top_p this small would otherwise also keep only token 1.
    assert Sampler({"do_sample": False, "top_p": 0.01}, device=device).sample(logits, [1]) == 1


def test_draw_matches_multinomial_stream() -> None:
    logits = _logits(1, 50)[0]
    sampler = Sampler({"temperature": 0.8, "seed": 1234})
    g = torch.Generator().manual_seed(1234)
    ours = [sampler.sample(logits, []) for _ in range(100)]
    probs = (logits / 0.8).softmax(-1)
    assert ours == [int(torch.multinomial(probs, 1, generator=g)) for _ in range(100)]


def test_ban_eos_token(device: str) -> None:
    logits = torch.tensor([0.0, 5.0, 9.0, 1.0], device=device)
    greedy = Sampler(
        {"do_sample": False, "ban_eos_token": True}, device=device, eos_token_ids=[2, 50]
    )
    assert greedy.sample(logits, []) == 1
    sampling = Sampler({"ban_eos_token": True, "seed": 0}, device=device, eos_token_ids=[2])
    draws = sampling.sample_batch(logits.expand(2000, -1), torch.empty(2000, 0).long())
    assert 2 not in draws.tolist()
    assert Sampler({"do_sample": False}, eos_token_ids=[2], device=device).sample(logits, []) == 2


def test_logits_on_another_device_are_refused() -> None:
    with pytest.raises(ValueError, match="logits are on meta"):
        Sampler(device="cpu").sample(torch.zeros(4, device="meta"), [])


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty_range", -5),
        ("max_new_tokens", -1),
        ("max_new_tokens", "100"),
        ("seed", -2),
        ("seed", True),
        ("do_sample", 1),
        ("temperature", "0.7"),
        ("stop", ["ok", 3]),
        ("stop_token_ids", [1, -2]),
        ("typical_p", 0.0),
        ("tfs", 1.5),
        ("top_a", -0.1),
        ("top_n_sigma", -1.0),
        ("epsilon_cutoff", -1.0),
        ("eta_cutoff", 1e4),
        ("xtc_threshold", 1.5),
        ("xtc_probability", 2),
        ("dry_multiplier", -1),
        ("dry_base", 0),
        ("dry_allowed_length", 0),
        ("dry_penalty_last_n", -2),
        ("dry_sequence_breakers", '"\\n", :'),
        ("dry_sequence_breakers", [1]),
        ("mirostat_mode", 3),
        ("mirostat_tau", -1.0),
        ("no_repeat_ngram_size", -1),
        ("min_new_tokens", 1.5),
        ("logit_bias", {"a": 1}),
        ("logit_bias", {"5": "x"}),
        ("custom_token_bans", "1, x"),
        ("custom_token_bans", [-1]),
        ("sampler_priority", 5),
        ("dynatemp_low", 0),
        ("smoothing_factor", -1),
        ("dynamic_temperature", "yes"),
    ],
)
def test_invalid_values_name_key_and_value(key: str, value: object) -> None:
    with pytest.raises(SamplingSettingsError, match=key) as info:
        SamplingSettings.from_any({key: value})
    assert repr(value) in str(info.value)


def test_integral_floats_are_taken_as_ints() -> None:
    s = SamplingSettings.from_any({"seed": -1.0, "max_new_tokens": 200.0, "top_k": 40})
    assert (s.seed, s.max_new_tokens) == (-1, 200)
    assert isinstance(s.seed, int) and isinstance(s.temperature, float)


def test_from_any_tgw_state() -> None:
    state = {
        "max_new_tokens": 300,
        "temperature": 0.7,
        "top_p": 0.9,
        "min_p": 0.05,
        "seed": 7,
        "custom_stopping_strings": '"\\n", "### "',
        "stopping_strings": ["\nUser:"],
        "typical_p": 1,
        "tfs": 0.95,
        "dry_multiplier": 0,
        "dry_base": 1.75,
        "xtc_probability": 0.5,
        "mirostat_mode": 0,
        "grammar_string": "",
        "sampler_priority": "repetition_penalty\npresence_penalty\nfrequency_penalty\ndry\n"
        "temperature\ndynamic_temperature\nquadratic_sampling\ntop_k\ntop_p\ntypical_p\n"
        "epsilon_cutoff\neta_cutoff\ntfs\ntop_a\nmin_p\nmirostat\nxtc",
        "mode": "instruct",
    }
    s = SamplingSettings.from_any(state)
    assert s.stop == ["\nUser:", "\n", "### "]
    assert (s.max_new_tokens, s.temperature, s.top_p, s.min_p, s.seed) == (300, 0.7, 0.9, 0.05, 7)
    assert s.extra["mode"] == "instruct" and "dry_base" not in s.extra
    assert (s.tfs, s.xtc_probability, s.dry_base) == (0.95, 0.5, 1.75)
    # Every sampler of that state is implemented now; what is not stays in `extra`.
    assert s.unsupported() == []
    other = {**state, "encoder_repetition_penalty": 1.2, "mirostat_mode": 1, "num_beams": 1}
    assert SamplingSettings.from_any(other).unsupported() == [
        "encoder_repetition_penalty",
        "mirostat_mode",
    ]
    swapped = SamplingSettings.from_any({"sampler_priority": "min_p\ntemperature\ntop_k"})
    assert swapped.unsupported() == []
    assert swapped.order[-3:] == ("min_p", "temperature", "top_k")
    # TGW moves temperature last on its own when temperature_last is set.
    moved = {"sampler_priority": "temperature\ntop_k\nmin_p", "temperature_last": True}
    assert SamplingSettings.from_any(moved).order[-5:] == (
        "top_k",
        "min_p",
        "temperature",
        "dynamic_temperature",
        "quadratic_sampling",
    )


def test_from_any_stop_forms() -> None:
    s = SamplingSettings.from_any({"stop": "END", "custom_stopping_strings": ["a", "END", ""]})
    assert s.stop == ["END", "a"]
    assert SamplingSettings.from_any({"custom_stopping_strings": ""}).stop == []
    with pytest.raises(SamplingSettingsError, match="custom_stopping_strings"):
        SamplingSettings.from_any({"custom_stopping_strings": '"unterminated'})


def test_default_order_and_temperature_last() -> None:
    assert sampler_order()[:6] == (
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "dry",
        "top_n_sigma",
        "temperature",
    )
    assert sampler_order()[-3:] == ("mirostat", "xtc", "no_repeat_ngram")
    assert sampler_order(True)[-3:] == ("temperature", "dynamic_temperature", "quadratic_sampling")
    s = SamplingSettings.from_any(
        {"temperature_last": True, "temperature": 0.5, "top_k": 5, "xtc_probability": 0.5}
    )
    assert Sampler(s).steps == ("top_k", "xtc", "temperature")
    # Mirostat draws in TGW, so what comes after it (here temperature) does nothing.
    miro = {"mirostat_mode": 2, "temperature": 0.5, "temperature_last": True, "top_k": 5}
    assert Sampler(miro).steps == ("top_k", "mirostat")
    assert Sampler({**miro, "do_sample": False, "repetition_penalty": 1.2}).steps == (
        "repetition_penalty",
    )


def test_tgw_string_forms() -> None:
    s = SamplingSettings.from_any(
        {
            "custom_token_bans": "1, 2,3",
            "dry_sequence_breakers": '"\\n", ":", "\\"", "*"',
            "logit_bias": {"5": 1},
            "sampler_priority": "",
        }
    )
    assert s.custom_token_bans == [1, 2, 3] and s.logit_bias == {5: 1.0}
    assert (
        s.dry_sequence_breakers == ["\n", ":", '"', "*"] == SamplingSettings().dry_sequence_breakers
    )
    assert SamplingSettings.from_any(
        {"dry_sequence_breakers": '["a", "b"]'}
    ).dry_sequence_breakers == ["a", "b"]
    assert s.order == sampler_order()
    with pytest.warns(UserWarning, match="sequence breakers"):
        Sampler({"dry_multiplier": 0.8})


def test_from_any_passes_dataclass_and_none() -> None:
    s = SamplingSettings(temperature=0.0, stop=["x"], extra={"guidance_scale": 1.5})
    copy = SamplingSettings.from_any(s)
    assert copy == s and copy is not s and copy.greedy
    assert copy.unsupported() == ["guidance_scale"]
    assert SamplingSettings.from_any(None) == SamplingSettings()
    # asdict() output comes back unchanged, `extra` included.
    from dataclasses import asdict

    assert SamplingSettings.from_any(asdict(s)) == s
    with pytest.raises(SamplingSettingsError, match="mapping"):
        SamplingSettings.from_any([("temperature", 1.0)])  # type: ignore[arg-type]
