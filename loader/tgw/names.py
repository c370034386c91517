"""Names Kestrel's TGW loader shares with text-generation-webui (TGW): the loader's name,
the controls TGW shows for it, and TGW's cache-type names in Kestrel's terms.

Pure data (no engine import): the installer (`kestrel-tgw`, `python -m loader.tgw`) needs
these to write TGW's files and must run where torch or triton is missing or broken.
"""

from __future__ import annotations

LOADER_NAME = "Kestrel"  # the name in TGW's loader menu and `--loader kestrel`

# Model-tab controls TGW shows for the Kestrel loader (TGW's loaders_and_params entry).
TGW_PARAMS: tuple[str, ...] = ("ctx_size", "cache_type", "gpu_split", "enable_tp", "cpu")

# Parameters-tab controls TGW shows for Kestrel (its loaders_samplers entry): the TGW
# sampling keys SamplingSettings implements, plus the ones this adapter handles itself.
ADAPTER_KEYS: frozenset[str] = frozenset({"auto_max_new_tokens"})
# Keys the engine reads from the settings' `extra` (engine/constraints): TGW's grammar box.
EXTRA_KEYS: frozenset[str] = frozenset({"grammar_string"})
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
    "grammar_string",
)

# Kestrel's KV-cache storage types (kernels/kv_quant.py CACHE_TYPES; a test keeps the two
# equal), offered in TGW's cache-type dropdown while the Kestrel loader is selected.
CACHE_TYPES: tuple[str, ...] = ("fp16", "fp8", "q8", "q6", "q4")

# TGW's names (its dropdown, --cache-type help) for the same storage as a Kestrel type:
# llama.cpp's q8_0 / q4_0 are 8- and 4-bit codes with a float16 scale per block of
# values, which is what Kestrel's q8 / q4 store; ExLlamaV3's "qK_qV" with K == V is qK.
TGW_CACHE_ALIASES: dict[str, str] = {
    "q8_0": "q8",
    "q4_0": "q4",
    **{f"q{bits}_q{bits}": f"q{bits}" for bits in (8, 6, 4)},
}


class CacheTypeError(ValueError):
    """A TGW cache type Kestrel has no storage for; the message lists Kestrel's."""


def kestrel_cache_type(value: object) -> str:
    """Kestrel's cache type for TGW's `cache_type` value (empty means fp16)."""
    name = str(value or "fp16").strip().lower()
    name = TGW_CACHE_ALIASES.get(name, name)
    if name not in CACHE_TYPES:
        raise CacheTypeError(
            f"cache_type {value!r}: Kestrel's KV cache can be {', '.join(CACHE_TYPES)} "
            f"(TGW's {', '.join(sorted(TGW_CACHE_ALIASES))} are taken as the Kestrel type "
            "of the same bits); pick one of those in the Model tab"
        )
    return name
