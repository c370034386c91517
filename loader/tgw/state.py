"""TGW's load flags and generation `state` in Kestrel's terms (pure: no TGW import).

text-generation-webui (TGW) hands a loader two things: `shared.args` (the Model tab's
controls, as command-line flags) at load time, and a `state` dict (the Parameters tab) for
each generation. Kestrel's SamplingSettings already uses TGW's state-key names, so the
sampling keys pass through unchanged; this module handles what is TGW-specific:

- load: `ctx_size` -> max_seq_len (0 lets Kestrel choose), `cache_type`, `gpu_split`
  ("20,7,7", GB per GPU) -> a list of floats, `enable_tp` -> tensor_parallel, `cpu` ->
  device "cpu". Unknown cache types are left for the engine to reject by name.
- generate: `truncation_length` keeps the last (truncation_length - max_new_tokens)
  prompt tokens, as TGW's own loaders do; `auto_max_new_tokens` fills the context;
  top_p 0 (TGW's slider allows it) keeps only the most likely token, which is what
  transformers' top-p warper does (min_tokens_to_keep=1). typical_p 0, which
  transformers refuses, is refused here too, by SamplingSettings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engine.sampling_settings import SamplingSettings
from loader.base import LoaderError

LOADER_NAME = "Kestrel"  # the name in TGW's loader menu and `--loader kestrel`

# Model-tab controls TGW shows for the Kestrel loader (TGW's loaders_and_params entry).
TGW_PARAMS: tuple[str, ...] = ("ctx_size", "cache_type", "gpu_split", "enable_tp", "cpu")

# Parameters-tab controls TGW shows for Kestrel (its loaders_samplers entry): the TGW
# sampling keys SamplingSettings implements, plus the ones this adapter handles itself.
ADAPTER_KEYS: frozenset[str] = frozenset({"auto_max_new_tokens"})
TGW_SAMPLERS: tuple[str, ...] = (
    "temperature",
    "dynatemp_low",
    "dynatemp_high",
    "dynatemp_exponent",
    "smoothing_factor",
    "smoothing_curve",
    "min_p",
    "top_p",
    "top_k",
    "typical_p",
    "xtc_threshold",
    "xtc_probability",
    "epsilon_cutoff",
    "eta_cutoff",
    "tfs",
    "top_a",
    "top_n_sigma",
    "dry_multiplier",
    "dry_allowed_length",
    "dry_base",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "no_repeat_ngram_size",
    "repetition_penalty_range",
    "mirostat_mode",
    "mirostat_tau",
    "mirostat_eta",
    "do_sample",
    "dynamic_temperature",
    "temperature_last",
    "auto_max_new_tokens",
    "ban_eos_token",
    "add_bos_token",
    "skip_special_tokens",
    "seed",
    "sampler_priority",
    "custom_token_bans",
    "dry_sequence_breakers",
)

# The smallest positive float: as top_p it keeps exactly the top token.
_KEEP_ONE = 5e-324


def _get(source: Any, key: str, default: Any = None) -> Any:
    if isinstance(source, Mapping):
        return source.get(key, default)
    return getattr(source, key, default)


def parse_gpu_split(value: Any) -> list[float] | None:
    """TGW's gpu_split text ("20,7,7", GB per GPU) as floats; empty means no split."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        parts = [str(v) for v in value]
    else:
        parts = [p for p in str(value).replace(" ", "").split(",") if p]
    if not parts:
        return None
    try:
        split = [float(p) for p in parts]
    except ValueError:
        raise LoaderError(
            f"gpu_split {value!r}: expected GB per GPU separated by commas, e.g. 20,7,7"
        ) from None
    if any(not (x > 0) for x in split):
        raise LoaderError(f"gpu_split {value!r}: every GPU needs a positive amount of GB")
    return split


def load_options(args: Any) -> dict[str, Any]:
    """Keyword arguments for `loader.load` from TGW's `shared.args` (or a dict of them)."""
    ctx_size = int(_get(args, "ctx_size", 0) or 0)
    if ctx_size < 0:
        raise LoaderError(f"ctx_size {ctx_size}: must be >= 0 (0 lets Kestrel choose)")
    cache_type = str(_get(args, "cache_type", "fp16") or "fp16").strip().lower()
    return {
        "device": "cpu" if _get(args, "cpu", False) else None,
        "max_seq_len": ctx_size or None,
        "cache_type": cache_type,
        "gpu_split": parse_gpu_split(_get(args, "gpu_split")),
        "tensor_parallel": bool(_get(args, "enable_tp", False)),
    }


def prompt_budget(state: Mapping[str, Any]) -> int | None:
    """How many prompt tokens TGW keeps (the last ones), or None for all of them."""
    truncation = int(state.get("truncation_length", 0) or 0)
    budget = truncation - int(state.get("max_new_tokens", 0) or 0)
    return budget if truncation > 0 and budget > 0 else None


def sampling_settings(state: Mapping[str, Any], prompt_tokens: int) -> SamplingSettings:
    """SamplingSettings for one TGW generation whose prompt has `prompt_tokens` tokens."""
    fixed = dict(state)
    top_p = fixed.get("top_p")
    if isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and top_p == 0:
        fixed["top_p"] = _KEEP_ONE
    if fixed.get("auto_max_new_tokens") and int(fixed.get("truncation_length", 0) or 0) > 0:
        fixed["max_new_tokens"] = max(int(fixed["truncation_length"]) - prompt_tokens, 0)
    # Objects TGW keeps in the state (a threading.Event, logits processors) mean nothing
    # here; leave them out of `extra` so the settings stay plain data.
    for key in ("stop_event", "logits_processor", "logprob_proc"):
        fixed.pop(key, None)
    return SamplingSettings.from_any(fixed)


def implemented_keys() -> frozenset[str]:
    """Every key TGW_SAMPLERS may name: a SamplingSettings field or an adapter key."""
    return frozenset(f.name for f in dataclasses.fields(SamplingSettings)) | ADAPTER_KEYS
