"""Model configuration read from a Hugging Face `config.json`.

`ModelConfig` keeps HF's field names so that an architecture file reads like the
checkpoint's own config. Keys an architecture needs but the dataclass does not name stay in
`extra` (the raw dict), so quirks live in the architecture file, not here.

Errors: a missing or unreadable file, a missing required key or a value of the wrong type
raises `ConfigError` naming the key and the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import KestrelError

REQUIRED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)
# Far above any real model (Llama 3.1 405B has 126); a larger count is a corrupt file, and
# building that many layers would hang the load before the weights could disagree.
MAX_LAYERS = 4096


class ConfigError(KestrelError, ValueError):
    """A model's config.json is missing, unreadable or lacks something Kestrel needs."""


@dataclass
class RopeParameters:
    """RoPE settings merged from `rope_theta`, `rope_scaling` (transformers 4) and
    `rope_parameters` (transformers 5): both spellings exist on the Hub."""

    rope_theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0
    short_factor: list[float] | None = None  # longrope (Phi-3): per-frequency divisors
    long_factor: list[float] | None = None


@dataclass
class ModelConfig:
    architectures: list[str]
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    rope: RopeParameters = field(default_factory=RopeParameters)
    # transformers 5 writes per-layer-type RoPE (Gemma 3: "full_attention" and
    # "sliding_attention") as nested `rope_parameters`; `rope` is then the full-attention one.
    rope_by_layer_type: dict[str, RopeParameters] = field(default_factory=dict)
    sliding_window: int | None = None
    quantization_config: dict[str, Any] | None = None
    source: str = "<memory>"
    model_dir: str | None = None  # set by from_dir; architectures may look at tensor names
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ConfigError(f"model directory not found: {model_dir}")
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object at the top level")
        config = cls.from_dict(raw, source=str(path))
        config.model_dir = str(model_dir)
        return config

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "<memory>") -> ModelConfig:
        # Multimodal checkpoints (Gemma 3, Llava) nest the language model's config.
        cfg = dict(raw)
        if "text_config" in cfg and "hidden_size" not in cfg:
            cfg = {**cfg["text_config"], "architectures": cfg.get("architectures", [])}

        for key in REQUIRED_KEYS:
            if key not in cfg:
                raise ConfigError(f"{source}: required key '{key}' is missing")
        # The required integer fields, by name (ModelConfig's keyword arguments).
        ints: dict[str, Any] = {key: _int(cfg, key, source) for key in REQUIRED_KEYS}
        architectures = cfg.get("architectures") or []
        if not isinstance(architectures, list) or not architectures:
            raise ConfigError(f"{source}: required key 'architectures' is missing or empty")
        if not all(isinstance(a, str) for a in architectures):
            raise ConfigError(
                f"{source}: 'architectures' must be a list of class names, got {architectures!r}"
            )

        heads = ints["num_attention_heads"]
        kv_heads = _int(cfg, "num_key_value_heads", source, default=heads)
        if kv_heads <= 0 or heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        if ints["num_hidden_layers"] > MAX_LAYERS:
            raise ConfigError(
                f"{source}: 'num_hidden_layers' is {ints['num_hidden_layers']}, more than any "
                f"model has (at most {MAX_LAYERS} accepted)"
            )
        if cfg.get("head_dim") is not None:
            head_dim = _int(cfg, "head_dim", source)
        elif ints["hidden_size"] < heads:
            raise ConfigError(
                f"{source}: hidden_size ({ints['hidden_size']}) is smaller than "
                f"num_attention_heads ({heads}) and there is no head_dim"
            )
        else:
            head_dim = ints["hidden_size"] // heads
        eos_list = _token_ids(cfg, "eos_token_id", source)
        bos = _token_ids(cfg, "bos_token_id", source)
        if len(bos) > 1:
            raise ConfigError(f"{source}: 'bos_token_id' must be one token id, got {bos}")

        return cls(
            architectures=list(architectures),
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=_int(cfg, "max_position_embeddings", source, default=2048),
            rms_norm_eps=_positive_float(cfg, "rms_norm_eps", source, default=1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=str(cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))),
            bos_token_id=bos[0] if bos else None,
            eos_token_id=eos_list,
            rope=_rope_parameters(cfg, source),
            rope_by_layer_type=_rope_by_layer_type(cfg, source),
            sliding_window=cfg.get("sliding_window"),
            quantization_config=cfg.get("quantization_config"),
            source=source,
            extra=cfg,
            **ints,
        )


def _int(cfg: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{source}: '{key}' must be a positive integer, got {value!r}")
    return value


def _positive_float(cfg: dict[str, Any], key: str, source: str, default: float) -> float:
    value = cfg.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{source}: '{key}' must be a positive number, got {value!r}")
    return float(value)


def _token_ids(cfg: dict[str, Any], key: str, source: str) -> list[int]:
    """A token id or a list of them (HF allows both); None: none."""
    value = cfg.get(key)
    values = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise ConfigError(f"{source}: '{key}' must be a token id or a list of them, got {value!r}")
    return values


def _nested_rope(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """`rope_parameters` keyed by layer type ({"full_attention": {...}, ...}), else None."""
    value = cfg.get("rope_parameters")
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return value
    return None


def _rope_by_layer_type(cfg: dict[str, Any], source: str) -> dict[str, RopeParameters]:
    nested = _nested_rope(cfg)
    if nested is None:
        return {}
    return {
        layer_type: _rope_parameters(
            {**cfg, "rope_scaling": None, "rope_parameters": params}, source
        )
        for layer_type, params in nested.items()
    }


def _rope_parameters(cfg: dict[str, Any], source: str) -> RopeParameters:
    nested = _nested_rope(cfg)
    if nested is not None:
        params = nested.get("full_attention", next(iter(nested.values())))
        cfg = {**cfg, "rope_scaling": None, "rope_parameters": params}
    merged: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if isinstance(value, dict):
            merged.update(value)
        elif value is not None:
            raise ConfigError(f"{source}: '{key}' must be an object, got {value!r}")
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    known = set(RopeParameters.__dataclass_fields__)
    params = {k: v for k, v in merged.items() if k in known}
    params["rope_theta"] = _positive_float({"rope_theta": theta}, "rope_theta", source, 10000.0)
    params["rope_type"] = str(rope_type)
    params.setdefault("partial_rotary_factor", float(cfg.get("partial_rotary_factor", 1.0)))
    return RopeParameters(**params)
