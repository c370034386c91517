"""The Model tab's load controls and how their values become `loader.load` arguments.

Which controls a loader shows comes from `loader.settings_schema(name)` where the loader
package offers it (the names of the options the loader takes); without it every control is
shown and a loader that does not take an option says so in its error when asked for it.
Options left at their neutral value (context 0, device "auto", RoPE alpha/scale 1, no
split) are not sent at all, so a loader is only ever asked for what the user set.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import loader
from webui.cli import CACHE_TYPES, parse_gpu_split

AUTO = "auto"
# Control names in page order; the values list handed to `load_kwargs` follows it.
OPTION_NAMES: tuple[str, ...] = (
    "max_seq_len",
    "cache_type",
    "gpu_split",
    "autosplit",
    "tensor_parallel",
    "rope_alpha",
    "rope_scale",
    "device",
    "dtype",
)
DTYPES = (AUTO, "float16", "bfloat16", "float32")
NEUTRAL: dict[str, Any] = {
    "max_seq_len": 0,
    "cache_type": "fp16",
    "gpu_split": "",
    "autosplit": False,
    "tensor_parallel": False,
    "rope_alpha": 1.0,
    "rope_scale": 1.0,
    "device": AUTO,
    "dtype": AUTO,
}
assert set(NEUTRAL) == set(OPTION_NAMES)
assert NEUTRAL["cache_type"] in CACHE_TYPES


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def devices() -> list[str]:
    """The device choices of this machine: auto, cpu and each CUDA device."""
    import torch

    found = [AUTO, "cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return found


def _schema_names(schema: Any) -> set[str]:
    """Option names from a settings schema: loader.settings_schema's SettingsSchema (its
    `names()`), a mapping keyed by name, or an iterable of names / dicts with "name" /
    objects with `.name`."""
    if hasattr(schema, "names") and callable(schema.names):
        return {str(n) for n in schema.names()}
    if isinstance(schema, dict):
        return {str(k) for k in schema}
    names = set()
    for item in schema if isinstance(schema, Iterable) else ():
        if isinstance(item, str):
            names.add(item)
        elif isinstance(item, dict) and "name" in item:
            names.add(str(item["name"]))
        elif hasattr(item, "name"):
            names.add(str(item.name))
    return names


def visible_options(loader_name: str | None) -> set[str]:
    """The controls to show for `loader_name`: those its settings schema names (a loader
    publishing an empty schema takes no options). With "auto" the loader is picked from
    the files at load time, and without `loader.settings_schema` nothing is known: then
    every control is shown and a loader refuses what it does not take, by name."""
    schema_fn = getattr(loader, "settings_schema", None)
    if not loader_name or loader_name == AUTO or schema_fn is None:
        return set(OPTION_NAMES)
    try:
        names = _schema_names(schema_fn(loader_name))
    except Exception:  # a plugin's broken schema must not hide the controls
        return set(OPTION_NAMES)
    return names & set(OPTION_NAMES)


def load_kwargs(values: dict[str, Any], shown: set[str] | None = None) -> dict[str, Any]:
    """`loader.load` keyword arguments from control values (only those in `shown`, the
    controls the chosen loader displays); raises ValueError naming a bad value (the GPU
    split text)."""
    if shown is not None:
        values = {k: v for k, v in values.items() if k in shown}
    out: dict[str, Any] = {}
    seq = _number(values, "max_seq_len", whole=True) or 0
    if seq < 0:
        raise ValueError(f"max_seq_len must be 0 (the model's own) or more, got {seq}")
    if seq > 0:
        out["max_seq_len"] = int(seq)
    if values.get("cache_type") not in (None, "", "fp16"):
        out["cache_type"] = values["cache_type"]
    split = parse_gpu_split(values.get("gpu_split"))
    if split:
        out["gpu_split"] = split
    for flag in ("autosplit", "tensor_parallel"):
        if values.get(flag):
            out[flag] = True
    for rope in ("rope_alpha", "rope_scale"):
        value = _number(values, rope)
        if value is not None and value != 1.0:
            out[rope] = value
    for choice in ("device", "dtype"):
        value = values.get(choice)
        if value and value != AUTO:
            out[choice] = value
    return out


def _number(values: dict[str, Any], key: str, *, whole: bool = False) -> float | None:
    """A finite number from a control (None when empty); a ValueError naming the key for
    text, NaN, infinity or (with `whole`) a fraction."""
    value = values.get(key)
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or (whole and not number.is_integer()):
        kind = "a whole number" if whole else "a finite number"
        raise ValueError(f"{key} must be {kind}, got {value!r}")
    return number


def values_from_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `load_kwargs`: control values for remembered load options."""
    values = dict(NEUTRAL)
    for key, value in kwargs.items():
        if key == "gpu_split" and value:
            values[key] = ",".join(f"{v:g}" for v in value)
        elif key in values and value is not None:
            values[key] = value
    return values
