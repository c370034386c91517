"""The Parameters tab's controls, one per generation setting, under TGW's state-key names.

Names and defaults come from `engine.sampling_settings.SamplingSettings` (the single source):
a control's default is the dataclass field's default, and every bound below is checked by
the unit tests to be a value `SamplingSettings` accepts. The slider ranges are TGW's
(modules/ui_parameters.py), narrowed where Kestrel's validation is stricter (top_p and
typical_p exclude 0). A few state keys are the UI's own, not sampler fields:
`truncation_length` (prompt budget) and `custom_stopping_strings` (TGW's stop-string box).

`state_from_values(values)` turns what the controls hold into a TGW-style state dict, the
form `SamplingSettings.from_any` and the extension hooks take.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from loader.values import SamplingSettings, check_settings_constraint

Kind = Literal["slider", "number", "checkbox", "text"]

_FIELDS = {f.name: f for f in dataclasses.fields(SamplingSettings)}


def field_default(name: str) -> Any:
    """The SamplingSettings default of `name` (a fresh copy for list/dict fields)."""
    f = _FIELDS[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING, name
    return f.default_factory()


@dataclass(frozen=True)
class Control:
    name: str  # the TGW state key
    kind: Kind
    group: str  # the box it is shown in
    minimum: float | None = None
    maximum: float | None = None
    step: float | None = None
    info: str = ""
    default_override: Any = None  # for keys that are not SamplingSettings fields

    @property
    def default(self) -> Any:
        if self.name in _FIELDS:
            value = field_default(self.name)
            return _as_text(self.name, value) if self.kind == "text" else value
        return self.default_override


def _as_text(name: str, value: Any) -> str:
    """A list/dict default in the string form TGW's text boxes use."""
    if name in ("sampler_priority", "banned_strings"):
        return "\n".join(value)
    if name == "dry_sequence_breakers":
        return ", ".join(json.dumps(s) for s in value)
    if name == "custom_token_bans":
        return ", ".join(str(i) for i in value)
    if name == "logit_bias":
        return json.dumps(value) if value else ""
    return str(value)


def _s(name: str, lo: float, hi: float, step: float, group: str, info: str = "") -> Control:
    return Control(name, "slider", group, lo, hi, step, info)


# The order within a group is the order on the page.
CONTROLS: tuple[Control, ...] = (
    _s("max_new_tokens", 1, 4096, 1, "length", "tokens to generate at most"),
    Control(
        "truncation_length",
        "slider",
        "length",
        0,
        131072,
        256,
        "prompt budget in tokens; older chat turns are dropped to fit (0: model context)",
        default_override=0,
    ),
    Control("seed", "number", "length", -1, None, 1, "-1: random"),
    Control(
        "custom_stopping_strings",
        "text",
        "length",
        info='extra stop strings, as TGW writes them: "\\n", "User:"',
        default_override="",
    ),
    _s("min_new_tokens", 0, 4096, 1, "length", "EOS is banned until this many tokens"),
    Control(
        "banned_strings",
        "text",
        "length",
        info="one a line: never generated (the text is rewound and resampled)",
    ),
    Control("ban_eos_token", "checkbox", "length"),
    Control("add_bos_token", "checkbox", "length"),
    Control("skip_special_tokens", "checkbox", "length"),
    # Curve shape
    Control("do_sample", "checkbox", "curve", info="off: greedy decoding"),
    _s("temperature", 0, 5, 0.01, "curve", "0: greedy"),
    Control("temperature_last", "checkbox", "curve", info="apply temperature after the filters"),
    Control("dynamic_temperature", "checkbox", "curve"),
    _s("dynatemp_low", 0.01, 5, 0.01, "curve"),
    _s("dynatemp_high", 0.01, 5, 0.01, "curve"),
    _s("dynatemp_exponent", 0.01, 5, 0.01, "curve"),
    _s("smoothing_factor", 0, 10, 0.01, "curve", "quadratic sampling; 0: off"),
    _s("smoothing_curve", 1, 10, 0.01, "curve"),
    # Truncation
    _s("min_p", 0, 1, 0.01, "truncation", "0: off"),
    _s("top_p", 0.01, 1, 0.01, "truncation", "1: off"),
    _s("top_k", 0, 200, 1, "truncation", "0: off"),
    _s("typical_p", 0.01, 1, 0.01, "truncation", "1: off"),
    _s("tfs", 0, 1, 0.01, "truncation", "1: off"),
    _s("top_a", 0, 1, 0.01, "truncation", "0: off"),
    _s("top_n_sigma", 0, 5, 0.01, "truncation", "0: off"),
    _s("epsilon_cutoff", 0, 9, 0.01, "truncation", "in units of 1e-4; 0: off"),
    _s("eta_cutoff", 0, 20, 0.01, "truncation", "in units of 1e-4; 0: off"),
    _s("xtc_threshold", 0, 0.5, 0.01, "truncation"),
    _s("xtc_probability", 0, 1, 0.01, "truncation", "0: XTC off"),
    # Repetition
    _s("repetition_penalty", 1, 1.5, 0.01, "repetition", "1: off"),
    _s("presence_penalty", 0, 2, 0.05, "repetition"),
    _s("frequency_penalty", 0, 2, 0.05, "repetition"),
    _s("repetition_penalty_range", 0, 4096, 64, "repetition", "last N tokens; 0: all"),
    _s("no_repeat_ngram_size", 0, 20, 1, "repetition", "0: off"),
    _s("dry_multiplier", 0, 5, 0.01, "repetition", "DRY; 0: off"),
    _s("dry_base", 1, 4, 0.01, "repetition"),
    _s("dry_allowed_length", 1, 20, 1, "repetition"),
    Control(
        "dry_penalty_last_n",
        "number",
        "repetition",
        -1,
        None,
        1,
        "-1: follow repetition_penalty_range; 0: the whole context",
    ),
    Control("dry_sequence_breakers", "text", "repetition"),
    # Mirostat
    _s(
        "mirostat_mode",
        0,
        2,
        1,
        "mirostat",
        "0: off, 2: mirostat 2. 1 (llama.cpp's mirostat 1) is not implemented: ignored, "
        "and the reply's status says so",
    ),
    _s("mirostat_tau", 0, 10, 0.01, "mirostat"),
    _s("mirostat_eta", 0, 1, 0.01, "mirostat"),
    # Tokens and order
    Control("custom_token_bans", "text", "other", info="token ids never sampled: 1, 2"),
    Control("logit_bias", "text", "other", info='JSON: {"token id": bias}'),
    Control("sampler_priority", "text", "other", info="one sampler name a line"),
    # Structured output (engine/constraints): TGW's grammar box.
    Control(
        "grammar_string",
        "text",
        "grammar",
        info="GBNF (as llama.cpp and TGW write it) or Lark: the reply follows it; empty: free",
        default_override="",
    ),
)

CONTROL_NAMES: tuple[str, ...] = tuple(c.name for c in CONTROLS)
# What a preset holds: the samplers, not the length/seed/stop settings (as in TGW, choosing
# a preset keeps your max_new_tokens, seed, stop strings and truncation length).
PRESET_NAMES: tuple[str, ...] = tuple(
    c.name for c in CONTROLS if c.group not in ("length", "grammar")
)
GROUP_TITLES: dict[str, str] = {
    "length": "Length, seed and stops",
    "curve": "Temperature",
    "truncation": "Truncation samplers",
    "repetition": "Repetition penalties and DRY",
    "mirostat": "Mirostat",
    "other": "Tokens and sampler order",
    "grammar": "Grammar (structured output)",
}
# SamplingSettings fields with no control: `stop` is fed by custom_stopping_strings (TGW's
# box), stop_token_ids by the model's own EOS tokens, extra holds foreign keys, and the
# per-request `loras` selection is set model-wide by the Model tab's LoRA panel.
NOT_SHOWN: frozenset[str] = frozenset({"stop", "stop_token_ids", "extra", "loras"})


def defaults() -> dict[str, Any]:
    """Every control's default value, keyed by state key."""
    return {c.name: c.default for c in CONTROLS}


def state_from_values(values: dict[str, Any]) -> dict[str, Any]:
    """A TGW-style state dict from control values: Gradio's floats for integer sliders are
    kept (SamplingSettings accepts integral floats) and the JSON logit-bias box is parsed.
    Raises ValueError naming the key for a box that does not parse."""
    state = dict(values)
    banned = state.get("banned_strings")
    if isinstance(banned, str):
        state["banned_strings"] = [line for line in banned.splitlines() if line.strip()]
    bias = state.get("logit_bias")
    if isinstance(bias, str):
        text = bias.strip()
        try:
            state["logit_bias"] = json.loads(text) if text else {}
        except json.JSONDecodeError as e:
            raise ValueError(f'logit_bias must be JSON like {{"42": -5}}, got {bias!r}') from e
    return state


def validate(values: dict[str, Any]) -> SamplingSettings:
    """The settings these values make; SamplingSettingsError/ValueError names a bad key (a
    grammar that does not compile is a ConstraintError saying where)."""
    settings = SamplingSettings.from_any(state_from_values(values))
    check_settings_constraint(settings)
    return settings
