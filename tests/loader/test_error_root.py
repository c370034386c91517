"""One error root for front ends (loader/errors.py): every error a request or a file can
cause is a KestrelError, still of its old built-in type, and names its field in `param`
where there is one (the API used to take the message's first word)."""

from __future__ import annotations

import pytest

import loader.errors as errors
from loader.values import SamplingSettings


def test_every_exported_error_derives_from_the_root() -> None:
    kinds = [getattr(errors, name) for name in errors.__all__ if name != "KestrelError"]
    assert kinds and all(issubclass(kind, errors.KestrelError) for kind in kinds)
    assert issubclass(errors.SamplingSettingsError, ValueError)  # old handlers still catch
    assert issubclass(errors.QueueFullError, RuntimeError)


@pytest.mark.parametrize(
    ("settings", "param"),
    [
        ({"top_k": "many"}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
        ({"custom_stopping_strings": '"unclosed'}, "custom_stopping_strings"),
        ({"logit_bias": {"5": 1e9}}, "logit_bias"),
    ],
)
def test_a_bad_setting_names_its_field(settings: dict, param: str) -> None:
    with pytest.raises(errors.SamplingSettingsError) as caught:
        SamplingSettings.from_any(settings)
    assert caught.value.param == param
