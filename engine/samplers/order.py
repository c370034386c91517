"""TGW's sampler names and the order in which `Sampler` applies them.

TGW (`sampler_priority`) sorts its logits processors by their position in a list of names.
Two rules of TGW are kept here:
- `temperature_last` moves temperature, dynamic_temperature and quadratic_sampling to the
  end of the list, in that order;
- a sampler whose name is missing from the list runs before all listed ones (TGW's sort
  key is -1 for it); here such samplers keep their default relative order.
Names TGW knows but Kestrel does not implement (adaptive_p, encoder_repetition_penalty)
and unknown names are accepted and ignored, as TGW ignores names without a processor.
"""

from __future__ import annotations

from collections.abc import Sequence

# TGW's default preset order (modules/presets.py), which its UI and API send.
TGW_PRIORITY: tuple[str, ...] = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "dry",
    "top_n_sigma",
    "temperature",
    "dynamic_temperature",
    "quadratic_sampling",
    "top_k",
    "top_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "tfs",
    "top_a",
    "min_p",
    "adaptive_p",
    "mirostat",
    "xtc",
    "encoder_repetition_penalty",
    "no_repeat_ngram",
)
NOT_IMPLEMENTED = frozenset({"adaptive_p", "encoder_repetition_penalty"})
IMPLEMENTED: tuple[str, ...] = tuple(n for n in TGW_PRIORITY if n not in NOT_IMPLEMENTED)
TEMPERATURE_STEPS = ("temperature", "dynamic_temperature", "quadratic_sampling")
# Steps that change logits whatever do_sample says (HF's "processors"); the others are
# "warpers" that greedy decoding skips, as transformers does.
PROCESSORS = frozenset(
    {"repetition_penalty", "presence_penalty", "frequency_penalty", "dry", "no_repeat_ngram"}
)


def parse_priority(value: str | Sequence[str] | None) -> list[str]:
    """TGW's text box form (names separated by newlines or commas) or a list, as names.

    Returns [] for None or an empty value, meaning the default order. Raises TypeError or
    ValueError on anything else; the settings module turns them into a keyed error.
    """
    if value is None:
        return []
    if isinstance(value, str):
        parts = value.replace("\n", ",").split(",")
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        parts = list(value)
    else:
        raise TypeError("must be a string of names or a list of strings")
    return [p.strip() for p in parts if p.strip()]


def sampler_order(
    temperature_last: bool = False, priority: Sequence[str] | None = None
) -> tuple[str, ...]:
    """The implemented samplers in the order `Sampler` applies them, by TGW name.

    `priority` is TGW's `sampler_priority` as names (None or empty: TGW's default).
    Whether a sampler is active depends on the settings; this is only the order.
    """
    names = list(dict.fromkeys(priority or TGW_PRIORITY))  # TGW uses the first occurrence
    if temperature_last:
        names = [n for n in names if n not in TEMPERATURE_STEPS] + list(TEMPERATURE_STEPS)
    listed = [n for n in names if n in IMPLEMENTED]
    unlisted = [n for n in IMPLEMENTED if n not in listed]
    return (*unlisted, *listed)
