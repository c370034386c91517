"""Llama family (Llama 2/3/3.1/3.2, and Mistral, whose configs it also reads).

Quirks: none beyond the shared blocks. `attention_bias` puts a bias on q/k/v/o (a few
fine-tunes), `mlp_bias` on the MLP; Mistral's `sliding_window` (null in v0.2+) is honoured.
"""

from __future__ import annotations

from torch import nn

from engine.architectures.base import CausalLM
from engine.config import ModelConfig
from engine.modules import AttentionSpec, DecoderLayer


class LlamaForCausalLM(CausalLM):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM")

    def build_layers(self, config: ModelConfig) -> list[nn.Module]:
        spec = AttentionSpec(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            sliding_window=config.sliding_window,
        )
        return [
            DecoderLayer(
                self.attention(spec, i),
                self.gated_mlp(
                    i,
                    config.hidden_size,
                    config.intermediate_size,
                    config.hidden_act,
                    config.mlp_bias,
                ),
                config.hidden_size,
                config.rms_norm_eps,
            )
            for i in range(config.num_hidden_layers)
        ]
