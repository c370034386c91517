"""Bad sampler settings, fuzzed with hypothesis: `SamplingSettings.from_any` either refuses a
value with a SamplingSettingsError naming the key, or every value it accepts generates on a
real (tiny, random) engine without an error inside the step, where it would fail every job
of the batch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from engine.engine import Engine, EngineOptions
from engine.sampling_settings import SamplingSettings, SamplingSettingsError
from helpers.model_factory import make_tiny_llama

hypothesis = pytest.importorskip("hypothesis")  # requirements-dev.txt
# (tests/engine/test_bad_inputs_sampling.py holds the fixed cases, which run without hypothesis)
st = hypothesis.strategies
given, settings, HealthCheck = hypothesis.given, hypothesis.settings, hypothesis.HealthCheck

FLOAT_KEYS = [
    "temperature", "top_p", "min_p", "typical_p", "tfs", "top_a", "top_n_sigma",
    "epsilon_cutoff", "eta_cutoff", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "dry_multiplier", "dry_base", "mirostat_tau", "mirostat_eta",
    "xtc_threshold", "xtc_probability", "smoothing_factor", "smoothing_curve",
    "dynatemp_low", "dynatemp_high", "dynatemp_exponent",
]  # fmt: skip
INT_KEYS = [
    "top_k", "repetition_penalty_range", "dry_allowed_length", "dry_penalty_last_n",
    "mirostat_mode", "no_repeat_ngram_size", "min_new_tokens", "seed", "max_new_tokens",
]  # fmt: skip
EDGES = [0, 1, -1, 0.5, 2, 1e-300, 5e-324, 1e-40, 1e6, 1e20, 1e39, 1e300, 2**31, 2**63, 2**70]
NUMBERS = st.one_of(
    st.sampled_from(EDGES),
    st.sampled_from(EDGES).map(lambda v: -v),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
)
# Mostly values a sampler accepts, so that the generation test runs many of them.
PLAUSIBLE = st.one_of(
    st.floats(min_value=0, max_value=3), st.integers(min_value=0, max_value=64), NUMBERS
)
ANY_VALUE = st.one_of(
    NUMBERS, st.booleans(), st.none(), st.text(max_size=8), st.lists(st.integers(), max_size=3)
)
VOCAB = 384
SWITCHES = {"do_sample": True, "dynamic_temperature": False, "temperature_last": False}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path: Path = tmp_path_factory.mktemp("tiny-fuzz")
    make_tiny_llama(path)
    return Engine.load(
        path,
        EngineOptions(
            device="cpu", dtype="float32", max_seq_len=128, page_size=16, cache_tokens=256
        ),
    )


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FLOAT_KEYS + INT_KEYS), ANY_VALUE, max_size=5))
def test_from_any_accepts_or_names_the_key(values: dict) -> None:
    try:
        parsed = SamplingSettings.from_any(values)
    except SamplingSettingsError as error:
        assert any(key in str(error) for key in values), error
        return
    for key in FLOAT_KEYS:
        value = getattr(parsed, key)
        assert math.isfinite(value) and abs(value) <= 1e6, (key, value)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    values=st.dictionaries(st.sampled_from(FLOAT_KEYS + INT_KEYS), PLAUSIBLE, max_size=4),
    switches=st.fixed_dictionaries(
        {
            "do_sample": st.booleans(),
            "dynamic_temperature": st.booleans(),
            "temperature_last": st.booleans(),
        }
    ),  # fmt: skip
    bias=st.dictionaries(st.integers(0, VOCAB - 1), PLAUSIBLE, max_size=2),
)
# Values that once passed validation and then failed inside the step (overflows in torch).
@hypothesis.example(values={"top_k": 2**63}, switches=SWITCHES, bias={})
@hypothesis.example(
    values={"dry_allowed_length": 10**20, "dry_multiplier": 1}, switches=SWITCHES, bias={}
)
@hypothesis.example(values={"mirostat_mode": 2, "mirostat_tau": 1e39}, switches=SWITCHES, bias={})
@hypothesis.example(values={}, switches=SWITCHES, bias={5: 1e39})
def test_accepted_settings_generate_without_error(
    engine: Engine, values: dict, switches: dict, bias: dict
) -> None:
    state = {**values, **switches, "logit_bias": bias}
    try:
        parsed = SamplingSettings.from_any(state)
    except SamplingSettingsError:
        hypothesis.event("refused")
        return
    hypothesis.event("generated")
    parsed.max_new_tokens = min(parsed.max_new_tokens, 3)
    sched = engine.scheduler
    job = sched.submit([5, 6, 7, 8, 9, 10, 5, 6, 7], parsed)
    tokens = [t for event in sched.stream(job) for t in event.token_ids]
    assert job.finish_reason in ("stop", "length") and job.error is None
    assert all(0 <= t < VOCAB for t in tokens)
    stats = sched.stats()
    assert stats["running"] == 0 and stats["free_pages"] == stats["usable_pages"]
