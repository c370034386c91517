"""TGW's load flags and generation `state` in Kestrel's terms (pure: no TGW import).

text-generation-webui (TGW) hands a loader two things: `shared.args` (the Model tab's
controls, as command-line flags) at load time, and a `state` dict (the Parameters tab) for
each generation. Kestrel's SamplingSettings already uses TGW's state-key names, so the
sampling keys pass through unchanged; this module handles what is TGW-specific:

- load: `ctx_size` -> max_seq_len (0 lets Kestrel choose), `cache_type` (TGW's names for
  the same storage mapped to Kestrel's, others refused naming Kestrel's; names.py),
  `gpu_split` ("20,7,7", GB per GPU) -> a list of floats, `enable_tp` -> tensor_parallel,
  `cpu` -> device "cpu".
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
from loader.tgw.names import (  # noqa: F401  (LOADER_NAME, TGW_PARAMS: re-exported)
    ADAPTER_KEYS,
    EXTRA_KEYS,
    LOADER_NAME,
    TGW_PARAMS,
    TGW_SAMPLERS,
    CacheTypeError,
    kestrel_cache_type,
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
    try:
        cache_type = kestrel_cache_type(_get(args, "cache_type", "fp16"))
    except CacheTypeError as e:
        raise LoaderError(str(e)) from None
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
    # TGW's API asks for k logprobs per token through a LogprobProcessor in the state
    # (model.py fills it); Kestrel's own `logprobs` setting makes the sampler compute them.
    count = getattr(logprob_processor(state), "logprobs", None)
    if isinstance(count, int) and not isinstance(count, bool) and count > 0:
        fixed["logprobs"] = count
    # Objects TGW keeps in the state (a threading.Event, logits processors) mean nothing
    # here; leave them out of `extra` so the settings stay plain data.
    for key in ("stop_event", "logits_processor", "logprob_proc"):
        fixed.pop(key, None)
    return SamplingSettings.from_any(fixed)


def logprob_processor(state: Mapping[str, Any]) -> Any:
    """The LogprobProcessor TGW's API puts into `state['logits_processor']` (and, for chat,
    `state['logprob_proc']`) when a request asks for logprobs; None otherwise. Found by
    what it records (`token_alternatives_history`), so that no TGW import is needed."""
    candidates = [state.get("logprob_proc"), *(state.get("logits_processor") or ())]
    return next((c for c in candidates if hasattr(c, "token_alternatives_history")), None)


# What TGW calls the settings SamplingSettings.unsupported() names, where it helps to say
# more than the key: CFG is two of them.
_IGNORED_NAMES = {
    "guidance_scale": "guidance_scale and negative_prompt (CFG)",
    "adaptive_target": "adaptive_target (adaptive-p sampling)",
    "mirostat_mode": "mirostat_mode 1 (mode 2 works)",
}


def ignored_text(keys: list[str]) -> str:
    """The ignored TGW settings `keys` as a warning shows them."""
    return ", ".join(_IGNORED_NAMES.get(key, key) for key in keys)


def implemented_keys() -> frozenset[str]:
    """Every key TGW_SAMPLERS may name: a SamplingSettings field or an adapter key."""
    fields = frozenset(f.name for f in dataclasses.fields(SamplingSettings))
    return fields | ADAPTER_KEYS | EXTRA_KEYS
