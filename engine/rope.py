"""Rotary position embedding tables.

`rope_tables(...)` turns a config's RoPE settings into cos/sin tables [max_pos, R/2]
(float32, attention scaling folded in) that `kernels.apply_rope` indexes by position.
The inverse frequencies follow transformers' `modeling_rope_utils` so logits match it.

Scaling types: default, linear, dynamic (NTK), yarn, llama3, longrope (Phi-3); plus
NTK-alpha (`rope_alpha`, exllamav2's `alpha_value`), which raises the base for every position,
and a linear scale (`rope_scale`, text-generation-webui's `compress_pos_emb`), which divides
every position by the factor on top of the config's own scaling.
Every function takes an optional `rope` that replaces `config.rope`, for architectures
whose layers use different settings (Gemma 3's local and global layers).

Dynamic NTK in transformers recomputes the base for every forward from the current length.
A KV cache holds keys rotated once, so Kestrel fixes the base for the engine's context
length instead (what llama.cpp and exllamav2 also do): identical to transformers up to the
original context, the same family of frequencies beyond it.

Longrope likewise: transformers switches from the short to the long factors once a sequence
grows past `original_max_position_embeddings`. Kestrel picks one set for the engine's
context length (the long factors when `max_seq_len` exceeds the original context, as
exllamav2 does), so cached keys never mix the two; identical to transformers whenever both
stay on the same side of the original context.
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig, RopeParameters

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def rotary_dim(config: ModelConfig, rope: RopeParameters | None = None) -> int:
    return int(config.head_dim * (rope or config.rope).partial_rotary_factor)


def inv_frequencies(
    config: ModelConfig,
    *,
    max_seq_len: int | None = None,
    rope_alpha: float = 1.0,
    rope_scale: float = 1.0,
    rope: RopeParameters | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [R/2] (float32) and the attention scaling for cos/sin."""
    inv_freq, scaling = _config_frequencies(config, max_seq_len, rope_alpha, rope)
    # Position p rotated as p / rope_scale: the same as frequencies divided by it.
    return (inv_freq / rope_scale if rope_scale != 1.0 else inv_freq), scaling


def _config_frequencies(
    config: ModelConfig,
    max_seq_len: int | None,
    rope_alpha: float,
    rope: RopeParameters | None,
) -> tuple[torch.Tensor, float]:
    rope = rope or config.rope
    dim = rotary_dim(config, rope)
    base = rope.rope_theta
    if rope_alpha != 1.0:
        base *= rope_alpha ** (dim / (dim - 2))
    rope_type = rope.rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{config.source}: rope type '{rope_type}' is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type in ("linear", "dynamic", "yarn", "llama3") and rope.factor is None:
        if rope_type != "yarn" or rope.original_max_position_embeddings is None:
            raise ValueError(f"{config.source}: rope type '{rope_type}' needs 'factor'")

    if rope_type == "dynamic" and max_seq_len and max_seq_len > config.max_position_embeddings:
        factor = _factor(rope)
        base *= ((factor * max_seq_len / config.max_position_embeddings) - (factor - 1)) ** (
            dim / (dim - 2)
        )
    if rope_type == "yarn":
        return _yarn(config, rope, base, dim)
    if rope_type == "longrope":
        return _longrope(config, rope, base, dim, max_seq_len)

    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / _factor(rope)
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, rope, config.max_position_embeddings)
    return inv_freq, 1.0


def _factor(rope: RopeParameters) -> float:
    """The scaling factor, which `inv_frequencies` checked the types that use it have."""
    assert rope.factor is not None
    return float(rope.factor)


def _llama3(inv_freq: torch.Tensor, rope: RopeParameters, max_pos: int) -> torch.Tensor:
    factor = _factor(rope)
    low_freq_factor = float(rope.low_freq_factor or 1.0)
    high_freq_factor = float(rope.high_freq_factor or 4.0)
    old_context_len = rope.original_max_position_embeddings or max_pos
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope(
    config: ModelConfig, rope: RopeParameters, base: float, dim: int, max_seq_len: int | None
) -> tuple[torch.Tensor, float]:
    original = rope.original_max_position_embeddings or config.max_position_embeddings
    # Phi-3 gives no factor: the ratio of the extended to the original context stands in.
    factor = rope.factor if rope.factor is not None else config.max_position_embeddings / original
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    use_long = max_seq_len is not None and max_seq_len > original
    factors = rope.long_factor if use_long else rope.short_factor
    which = "long_factor" if use_long else "short_factor"
    if factors is None or len(factors) != dim // 2:
        raise ValueError(
            f"{config.source}: rope type 'longrope' needs '{which}' with {dim // 2} entries, "
            f"got {None if factors is None else len(factors)}"
        )
    ext = torch.tensor(factors, dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base**exponents), float(attention_factor)


def _yarn(
    config: ModelConfig, rope: RopeParameters, base: float, dim: int
) -> tuple[torch.Tensor, float]:
    original = rope.original_max_position_embeddings or config.max_position_embeddings
    factor = rope.factor if rope.factor is not None else config.max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def rope_tables(
    config: ModelConfig,
    max_seq_len: int,
    *,
    rope_alpha: float = 1.0,
    rope_scale: float = 1.0,
    device: torch.device | str = "cpu",
    rope: RopeParameters | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_seq_len, R/2] in float32 with attention scaling applied."""
    inv_freq, scaling = inv_frequencies(
        config, max_seq_len=max_seq_len, rope_alpha=rope_alpha, rope_scale=rope_scale, rope=rope
    )
    positions = torch.arange(max_seq_len, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]  # [P, R/2]
    cos, sin = angles.cos() * scaling, angles.sin() * scaling
    return cos.to(device), sin.to(device)
