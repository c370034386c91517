"""Sampling settings under text-generation-webui's (TGW) state-key names.

`SamplingSettings` is the typed form of the `settings` argument of the Loader interface.
`SamplingSettings.from_any` takes the dataclass itself, a dict of TGW state keys (the whole
TGW `state` may be passed: keys that are not ours are kept in `extra`), or None.

Contract:
- Every field is validated on construction; a bad value raises `SamplingSettingsError`
  naming the key and the value. Integer fields accept integral floats (Gradio numbers
  arrive as `-1.0`); booleans are never taken for numbers.
- TGW's string forms are parsed: `custom_stopping_strings` ('"\\n", "User:"'),
  `custom_token_bans` ("1, 2"), `dry_sequence_breakers` ('"\\n", ":"', JSON) and
  `sampler_priority` (names separated by newlines or commas); lists are taken as well.
- Stop strings end up in `stop` (a list): TGW's `custom_stopping_strings`, TGW's internal
  `stopping_strings` and an OpenAI-style single `stop` string are merged, empty ones dropped.
- Units are TGW's: `epsilon_cutoff` and `eta_cutoff` are in 1e-4 (3 means 3e-4).
- TGW sampling keys Kestrel does not implement stay in `extra`; `unsupported()` names those
  set to a value that would change sampling, so the caller can warn. Not implemented:
  encoder_repetition_penalty (needs the prompt apart from the generated tokens, which the
  sampler is not given), mirostat_mode 1 (llama.cpp only in TGW too), adaptive_p,
  guidance_scale/negative_prompt, contrastive search, beams and min_length. TGW's
  `grammar_string` (and Kestrel's json_schema, json_object, regex, lark) stay in `extra`
  and constrain the job's output (engine/constraints).
  Banned strings are the generator's job (it must rewind the text), not the sampler's.
- Sizes are bounded so that no accepted value can overflow inside a step (where it would
  fail the whole batch): counts up to 2**31 - 1, floats up to 1e6 in size, logit_bias in
  [-100, 100] (OpenAI's range), at most 256 stop / banned strings of 1000 characters each.
- Greedy decoding when `do_sample` is False or `temperature` is 0, as in TGW.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.samplers.order import TGW_PRIORITY, parse_priority, sampler_order
from engine.samplers.parse import (
    SamplingSettingsError,
    as_float,
    as_int,
    as_str_list,
    as_token_ids,
    check_bool,
    check_range,
    check_strings,
    parse_logit_bias,
    parse_loras,
    parse_sequence_breakers,
    parse_stop,
)

__all__ = ["SamplingSettings", "SamplingSettingsError", "sampler_order"]

# TGW keys that change sampling and are not implemented, with the value at which they do
# nothing. Keys that only matter while another key is active (negative_prompt without
# guidance_scale) are left out, so that TGW's default state reports nothing.
_NEUTRAL_VALUES: dict[str, Any] = {
    "encoder_repetition_penalty": 1.0,
    "adaptive_target": 0.0,
    "guidance_scale": 1.0,
    "penalty_alpha": 0.0,
    "num_beams": 1,
    "min_length": 0,
}
_STOP_KEYS = ("stop", "stopping_strings", "custom_stopping_strings")

# Token counts and lengths reach torch as 64-bit ints (top_k, slices): a bound far above
# any context keeps a huge value a clear error instead of an overflow inside a step, where
# it would fail every job of the batch. max_new_tokens is clamped to the context instead.
MAX_COUNT = 2**31 - 1
# Every float setting is at most this large in size: beyond it a value can only overflow
# float32 logits (a bias of 1e39 is inf), and no sampler means anything there.
MAX_FLOAT = 1e6
_Rule = tuple[str, Callable[[Any], bool], str]
_INT_RULES: tuple[_Rule, ...] = (
    ("max_new_tokens", lambda v: v >= 0, ">= 0"),
    ("top_k", lambda v: 0 <= v <= MAX_COUNT, f"in [0, {MAX_COUNT}] (0 turns it off)"),
    (
        "repetition_penalty_range",
        lambda v: 0 <= v <= MAX_COUNT,
        f"in [0, {MAX_COUNT}] (0 means the whole context)",
    ),
    # torch.Generator.manual_seed takes at most 64 bits.
    ("seed", lambda v: -1 <= v < 2**64, "-1 (random) or in [0, 2**64)"),
    ("dry_allowed_length", lambda v: 1 <= v <= MAX_COUNT, f"in [1, {MAX_COUNT}]"),
    (
        "dry_penalty_last_n",
        lambda v: -1 <= v <= MAX_COUNT,
        f"-1 (repetition_penalty_range), 0 (all) or in [1, {MAX_COUNT}]",
    ),
    ("mirostat_mode", lambda v: v in (0, 1, 2), "0 (off), 1 (not implemented) or 2"),
    ("no_repeat_ngram_size", lambda v: 0 <= v <= MAX_COUNT, f"in [0, {MAX_COUNT}] (0: off)"),
    ("min_new_tokens", lambda v: 0 <= v <= MAX_COUNT, f"in [0, {MAX_COUNT}]"),
)
_FLOAT_RULES: tuple[_Rule, ...] = (
    ("temperature", lambda v: v >= 0, ">= 0"),
    ("dynatemp_low", lambda v: v > 0, "> 0"),
    ("dynatemp_high", lambda v: v > 0, "> 0"),
    ("dynatemp_exponent", lambda v: v >= 0, ">= 0"),
    ("smoothing_factor", lambda v: v >= 0, ">= 0 (0 turns it off)"),
    ("smoothing_curve", lambda v: True, "a finite number"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("top_a", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("typical_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("tfs", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("top_n_sigma", lambda v: v >= 0, ">= 0 (0 turns it off)"),
    ("epsilon_cutoff", lambda v: 0 <= v < 1e4, "in [0, 10000) (units of 1e-4)"),
    ("eta_cutoff", lambda v: 0 <= v < 1e4, "in [0, 10000) (units of 1e-4)"),
    ("xtc_threshold", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("xtc_probability", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("dry_multiplier", lambda v: v >= 0, ">= 0 (0 turns it off)"),
    ("dry_base", lambda v: v > 0, "> 0"),
    ("mirostat_tau", lambda v: v >= 0, ">= 0"),
    ("mirostat_eta", lambda v: v >= 0, ">= 0"),
    ("repetition_penalty", lambda v: v > 0, "> 0"),
    ("presence_penalty", lambda v: True, "a finite number"),
    ("frequency_penalty", lambda v: True, "a finite number"),
)
_BOOL_FIELDS = (
    "do_sample",
    "temperature_last",
    "dynamic_temperature",
    "ban_eos_token",
    "add_bos_token",
    "skip_special_tokens",
)


def _default_breakers() -> list[str]:
    return ["\n", ":", '"', "*"]  # TGW's default '"\\n", ":", "\\"", "*"'


@dataclass
class SamplingSettings:
    max_new_tokens: int = 512
    do_sample: bool = True
    temperature: float = 1.0
    temperature_last: bool = False  # TGW: temperature (and its variants) after the filters
    # Dynamic temperature: dynatemp_low + (high - low) * (H / H_max) ** exponent, H the
    # entropy and H_max that of a uniform distribution over the tokens still in play.
    dynamic_temperature: bool = False
    dynatemp_low: float = 1.0
    dynatemp_high: float = 1.0
    dynatemp_exponent: float = 1.0
    smoothing_factor: float = 0.0  # quadratic sampling; 0: off
    smoothing_curve: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    top_a: float = 0.0  # 0: off
    typical_p: float = 1.0  # 1: off
    tfs: float = 1.0  # 1: off
    top_n_sigma: float = 0.0  # 0: off
    epsilon_cutoff: float = 0.0  # units of 1e-4, as in TGW; 0: off
    eta_cutoff: float = 0.0  # units of 1e-4, as in TGW; 0: off
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    # Last N context tokens (0: the whole context). 1024 is TGW's default: a penalty over a
    # long chat's whole history would also push down words the reply needs.
    repetition_penalty_range: int = 1024
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0  # 0: off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: list[str] = field(default_factory=_default_breakers)
    # DRY's look-back: -1 follows repetition_penalty_range (what TGW does), 0 the whole
    # context, N > 0 the last N tokens.
    dry_penalty_last_n: int = -1
    mirostat_mode: int = 0  # 2: mirostat 2; 1 is not implemented (llama.cpp only)
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    no_repeat_ngram_size: int = 0  # 0: off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to logit
    custom_token_bans: list[int] = field(default_factory=list)  # token ids never sampled
    min_new_tokens: int = 0  # EOS banned until this many tokens were generated
    sampler_priority: list[str] = field(default_factory=lambda: list(TGW_PRIORITY))
    seed: int = -1  # -1: random, drawn by the sampler and reported as `Sampler.seed`
    stop: list[str] = field(default_factory=list)
    # Strings the text must never contain (case-insensitive, exllamav2's semantics): the
    # generator rewinds to where one began, bans that token there and samples again.
    banned_strings: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ban_eos_token: bool = False
    add_bos_token: bool = True
    skip_special_tokens: bool = True
    # LoRA adapters for this request, {name: scale} (a list of names means scale 1 each);
    # None: the model's selection (set_loras), {}: none.
    loras: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, ok, expected in _INT_RULES:
            value = as_int(name, getattr(self, name))
            check_range(name, value, ok(value), expected)
            setattr(self, name, value)
        for name, ok, expected in _FLOAT_RULES:
            number = as_float(name, getattr(self, name))
            check_range(name, number, ok(number), expected)
            check_range(name, number, abs(number) <= MAX_FLOAT, f"at most {MAX_FLOAT:g} in size")
            setattr(self, name, number)
        for name in _BOOL_FIELDS:
            check_bool(name, getattr(self, name))
        self.dry_sequence_breakers = parse_sequence_breakers(
            "dry_sequence_breakers", self.dry_sequence_breakers
        )
        self.logit_bias = parse_logit_bias("logit_bias", self.logit_bias)
        self.custom_token_bans = as_token_ids("custom_token_bans", self.custom_token_bans)
        try:
            priority = parse_priority(self.sampler_priority)
        except TypeError as e:
            raise SamplingSettingsError(
                f"sampler_priority {e}, got {self.sampler_priority!r}", param="sampler_priority"
            ) from None
        self.sampler_priority = priority or list(TGW_PRIORITY)
        self.stop = check_strings("stop", as_str_list("stop", self.stop))
        raw_banned: object = self.banned_strings  # a caller may give one string
        if isinstance(raw_banned, str):
            raw_banned = [raw_banned]
        banned = [b for b in as_str_list("banned_strings", raw_banned) if b]
        self.banned_strings = check_strings("banned_strings", banned)
        self.stop_token_ids = as_token_ids("stop_token_ids", self.stop_token_ids)
        self.loras = parse_loras("loras", self.loras, MAX_FLOAT)
        if not isinstance(self.extra, dict):
            raise SamplingSettingsError(f"extra must be a dict, got {self.extra!r}", param="extra")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @property
    def order(self) -> tuple[str, ...]:
        """The implemented samplers, by TGW name, in the order the Sampler applies them."""
        return sampler_order(self.temperature_last, self.sampler_priority)

    @classmethod
    def from_any(cls, obj: SamplingSettings | Mapping[str, Any] | None) -> SamplingSettings:
        """Settings from the dataclass (validated copy), a TGW-style dict, or None."""
        if obj is None:
            return cls()
        if isinstance(obj, SamplingSettings):
            return dataclasses.replace(
                obj,
                stop=list(obj.stop),
                banned_strings=list(obj.banned_strings),
                extra=dict(obj.extra),
                logit_bias=dict(obj.logit_bias),
                custom_token_bans=list(obj.custom_token_bans),
                dry_sequence_breakers=list(obj.dry_sequence_breakers),
                sampler_priority=list(obj.sampler_priority),
                loras=None if obj.loras is None else dict(obj.loras),
            )
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
            for s in parse_stop(key, obj.get(key)):
                if s and s not in stop:
                    stop.append(s)
        return cls(**known, stop=stop, extra=extra)

    def unsupported(self) -> list[str]:
        """TGW keys set to a value that would change sampling in TGW but are ignored here."""
        keys = [
            key
            for key, neutral in _NEUTRAL_VALUES.items()
            if key in self.extra and not _is_neutral(self.extra[key], neutral)
        ]
        if self.mirostat_mode == 1:
            keys.append("mirostat_mode")
        return keys


def _is_neutral(value: Any, neutral: Any) -> bool:
    if value is None or value == neutral:
        return True
    return isinstance(value, str) and isinstance(neutral, str) and not value.strip()
