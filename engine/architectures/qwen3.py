"""Qwen3 dense models (Qwen3ForCausalLM).

Quirks: per-head RMSNorm of q and k (`self_attn.q_norm`, `self_attn.k_norm`, over head_dim)
before RoPE; no q/k/v bias unless `attention_bias`; `head_dim` is explicit and need not be
hidden_size / heads (Qwen3-0.6B: 1024 hidden, 16 heads, head_dim 128). Sliding windows
follow Qwen2's `use_sliding_window` rules.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from engine.architectures.base import CausalLM
from engine.architectures.qwen2 import qwen_layer_windows
from engine.config import ModelConfig
from engine.modules import AttentionSpec, DecoderLayer


def qwen3_attention_spec(config: ModelConfig) -> AttentionSpec:
    return AttentionSpec(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        qkv_bias=config.attention_bias,
        o_bias=config.attention_bias,
        qk_norm=True,
        norm_eps=config.rms_norm_eps,
    )


class Qwen3ForCausalLM(CausalLM):
    architectures = ("Qwen3ForCausalLM",)

    def build_layers(self, config: ModelConfig) -> list[nn.Module]:
        spec = qwen3_attention_spec(config)
        return [
            DecoderLayer(
                self.attention(replace(spec, sliding_window=window), i),
                self.gated_mlp(i, config.hidden_size, config.intermediate_size, config.hidden_act),
                config.hidden_size,
                config.rms_norm_eps,
            )
            for i, window in enumerate(qwen_layer_windows(config))
        ]
