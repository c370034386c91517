"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM).

Quirks: q/k/v always carry a bias and o_proj never does, whatever `attention_bias` says.
Sliding-window attention is off unless `use_sliding_window` is true: Hub configs written by
transformers 4 carry a `sliding_window` (e.g. 131072) that applies to nothing; when it is
on, it applies to layers >= `max_window_layers` (or to the sliding ones of `layer_types`).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from engine.architectures.base import CausalLM, layer_types, layer_windows
from engine.config import ModelConfig
from engine.modules import AttentionSpec, DecoderLayer


def qwen_layer_windows(config: ModelConfig) -> list[int | None]:
    """Each layer's sliding window under Qwen2/Qwen3's `use_sliding_window` rules."""
    if not config.extra.get("use_sliding_window", False):
        return [None] * config.num_hidden_layers
    first_windowed = int(config.extra.get("max_window_layers", config.num_hidden_layers))
    types = layer_types(
        config, lambda i: "sliding_attention" if i >= first_windowed else "full_attention"
    )
    return layer_windows(config, types)


class Qwen2ForCausalLM(CausalLM):
    architectures = ("Qwen2ForCausalLM",)

    def build_layers(self, config: ModelConfig) -> list[nn.Module]:
        spec = AttentionSpec(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            qkv_bias=True,
            o_bias=False,
        )
        return [
            DecoderLayer(
                self.attention(replace(spec, sliding_window=window), i),
                self.gated_mlp(i, config.hidden_size, config.intermediate_size, config.hidden_act),
                config.hidden_size,
                config.rms_norm_eps,
            )
            for i, window in enumerate(qwen_layer_windows(config))
        ]
