"""Sampler settings too large to be safe inside a step (they overflowed in torch and failed
every job of the batch) are refused by `SamplingSettings` with an error naming the key.
tests/engine/test_fuzz_sampling.py searches for more with hypothesis."""

from __future__ import annotations

import pytest

from engine.sampling_settings import SamplingSettings, SamplingSettingsError


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("top_k", 10**20),
        ("dry_allowed_length", 2**40),
        ("mirostat_tau", 1e39),
        ("temperature", 1e300),
        ("presence_penalty", -1e7),
        ("logit_bias", {"5": 1e39}),
        ("logit_bias", {"5": float("nan")}),
        ("logit_bias", {"5": 101}),
        ("loras", {"x": 1e300}),
        ("stop", [f"s{i}" for i in range(300)]),
        ("stop", ["x" * 1001]),
        ("banned_strings", ["y" * 5000]),
    ],
)
def test_huge_values_are_refused_by_name(key: str, value: object) -> None:
    with pytest.raises(SamplingSettingsError, match=key):
        SamplingSettings.from_any({key: value})
