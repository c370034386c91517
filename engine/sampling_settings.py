"""Sampling settings under text-generation-webui's (TGW) state-key names.

`SamplingSettings` is the typed form of the `settings` argument of the Loader interface.
`SamplingSettings.from_any` takes the dataclass itself, a dict of TGW state keys (the whole
TGW `state` may be passed: keys that are not ours are kept in `extra`), or None.

Contract:
- Every field is validated on construction; a bad value raises `SamplingSettingsError`
  naming the key and the value. Integer fields accept integral floats (Gradio numbers
  arrive as `-1.0`); booleans are never taken for numbers.
- Stop strings end up in `stop` (a list): TGW's `custom_stopping_strings` (the string form
  TGW stores, `'"\\n", "User:"'`, or a list), TGW's internal `stopping_strings` and an
  OpenAI-style single `stop` string are merged into it, empty strings dropped.
- TGW sampling keys Kestrel does not implement yet stay in `extra`; `unsupported()` names
  those set to a value that would change sampling, so the caller can warn.
- Greedy decoding when `do_sample` is False or `temperature` is 0, as in TGW.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# TGW keys that change sampling, with the value at which they do nothing. Keys that only
# matter while another key is active (dry_base without dry_multiplier) are in
# _DEPENDENT_KEYS instead, so that TGW's default state reports nothing.
_NEUTRAL_VALUES: dict[str, Any] = {
    "typical_p": 1.0,
    "tfs": 1.0,
    "top_a": 0.0,
    "top_n_sigma": 0.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "dynamic_temperature": False,
    "smoothing_factor": 0.0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "mirostat_mode": 0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "guidance_scale": 1.0,
    "penalty_alpha": 0.0,
    "num_beams": 1,
    "min_length": 0,
    "custom_token_bans": "",
    "grammar_string": "",
    "logit_bias": {},
}
_DEPENDENT_KEYS = frozenset(
    {
        "dynatemp_low",
        "dynatemp_high",
        "dynatemp_exponent",
        "smoothing_curve",
        "dry_base",
        "dry_allowed_length",
        "dry_sequence_breakers",
        "xtc_threshold",
        "mirostat_tau",
        "mirostat_eta",
        "negative_prompt",
        "length_penalty",
        "early_stopping",
    }
)
_STOP_KEYS = ("stop", "stopping_strings", "custom_stopping_strings")


def sampler_order(temperature_last: bool) -> tuple[str, ...]:
    """The order in which `engine.sampling.Sampler` applies its steps, by TGW name."""
    penalties = ("repetition_penalty", "presence_penalty", "frequency_penalty")
    if temperature_last:
        return (*penalties, "top_k", "top_p", "min_p", "temperature")
    return (*penalties, "temperature", "top_k", "top_p", "min_p")


class SamplingSettingsError(ValueError):
    """A sampling setting has a value of the wrong type or out of range."""


@dataclass
class SamplingSettings:
    max_new_tokens: int = 512
    do_sample: bool = True
    temperature: float = 1.0
    temperature_last: bool = False  # TGW: apply temperature after top_k/top_p/min_p
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    repetition_penalty_range: int = 0  # last N context tokens; 0: the whole context
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1  # -1: random, drawn by the sampler and reported as `Sampler.seed`
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ban_eos_token: bool = False
    add_bos_token: bool = True
    skip_special_tokens: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k", "repetition_penalty_range", "seed"):
            setattr(self, name, _as_int(name, getattr(self, name)))
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            setattr(self, name, _as_float(name, getattr(self, name)))
        for name in ("do_sample", "temperature_last", "ban_eos_token", "add_bos_token"):
            _check_bool(name, getattr(self, name))
        _check_bool("skip_special_tokens", self.skip_special_tokens)

        _check_range("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 0, ">= 0")
        _check_range("temperature", self.temperature, self.temperature >= 0, ">= 0")
        _check_range("top_k", self.top_k, self.top_k >= 0, ">= 0 (0 turns it off)")
        _check_range("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]")
        _check_range("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1]")
        _check_range(
            "repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0, "> 0"
        )
        _check_range(
            "repetition_penalty_range",
            self.repetition_penalty_range,
            self.repetition_penalty_range >= 0,
            ">= 0 (0 means the whole context)",
        )
        # torch.Generator.manual_seed takes at most 64 bits.
        _check_range("seed", self.seed, -1 <= self.seed < 2**64, "-1 (random) or in [0, 2**64)")
        self.stop = _as_str_list("stop", self.stop)
        self.stop_token_ids = _as_token_ids("stop_token_ids", self.stop_token_ids)
        if not isinstance(self.extra, dict):
            raise SamplingSettingsError(f"extra must be a dict, got {self.extra!r}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @classmethod
    def from_any(cls, obj: SamplingSettings | Mapping[str, Any] | None) -> SamplingSettings:
        """Settings from the dataclass (validated copy), a TGW-style dict, or None."""
        if obj is None:
            return cls()
        if isinstance(obj, SamplingSettings):
            return dataclasses.replace(obj, stop=list(obj.stop), extra=dict(obj.extra))
        if not isinstance(obj, Mapping):
            raise SamplingSettingsError(
                f"settings must be SamplingSettings, a mapping or None, got {type(obj).__name__}"
            )
        names = {f.name for f in dataclasses.fields(cls)} - {"stop", "extra"}
        known: dict[str, Any] = {}
        extra: dict[str, Any] = dict(obj.get("extra") or {})
        for key, value in obj.items():
            if key in names:
                known[key] = value
            elif key not in _STOP_KEYS and key != "extra":
                extra[key] = value
        stop: list[str] = []
        for key in _STOP_KEYS:
            for s in _parse_stop(key, obj.get(key)):
                if s and s not in stop:
                    stop.append(s)
        return cls(**known, stop=stop, extra=extra)

    def unsupported(self) -> list[str]:
        """Keys in `extra` whose values would change sampling in TGW but are ignored here."""
        keys = [
            key
            for key, neutral in _NEUTRAL_VALUES.items()
            if key in self.extra and not _is_neutral(self.extra[key], neutral)
        ]
        priority = self.extra.get("sampler_priority")
        if priority and _priority_differs(priority, self.temperature_last):
            keys.append("sampler_priority")
        return keys


def _is_neutral(value: Any, neutral: Any) -> bool:
    if value is None or value == neutral:
        return True
    return isinstance(value, str) and isinstance(neutral, str) and not value.strip()


def _priority_differs(priority: str | list[str], temperature_last: bool) -> bool:
    # TGW stores the priority as newline-separated names; the API may send a list.
    names = priority.split() if isinstance(priority, str) else [str(p) for p in priority]
    if temperature_last and "temperature" in names:
        # TGW moves temperature last when temperature_last is set, whatever the list says.
        names = [n for n in names if n != "temperature"] + ["temperature"]
    ours = sampler_order(temperature_last)
    return [n for n in names if n in ours] != [n for n in ours if n in names]


def _parse_stop(key: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        if key != "custom_stopping_strings":
            return [value]
        # TGW's own parsing of the text box: a comma-separated list of Python string
        # literals, with escapes such as \n written out.
        try:
            parsed = ast.literal_eval(f"[{value}]")
        except (ValueError, SyntaxError) as e:
            raise SamplingSettingsError(
                f'{key} must look like \'"\\n", "User:"\', got {value!r} ({e})'
            ) from None
        return _as_str_list(key, parsed)
    return _as_str_list(key, value)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and float(value).is_integer()
    ):
        return int(value)
    raise SamplingSettingsError(f"{name} must be an integer, got {value!r}")


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        if math.isfinite(value):
            return value
    raise SamplingSettingsError(f"{name} must be a finite number, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise SamplingSettingsError(f"{name} must be True or False, got {value!r}")


def _check_range(name: str, value: float, ok: bool, expected: str) -> None:
    if not ok:
        raise SamplingSettingsError(f"{name} must be {expected}, got {value!r}")


def _as_str_list(name: str, value: Any) -> list[str]:
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return list(value)
    raise SamplingSettingsError(f"{name} must be a list of strings, got {value!r}")


def _as_token_ids(name: str, value: Any) -> list[int]:
    if isinstance(value, (list, tuple)):
        try:
            ids = [_as_int(name, v) for v in value]
        except SamplingSettingsError:
            ids = None
        if ids is not None and all(i >= 0 for i in ids):
            return ids
    raise SamplingSettingsError(f"{name} must be a list of token ids (ints >= 0), got {value!r}")
