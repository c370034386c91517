"""Phi-3 / Phi-3.5 / Phi-4-mini (Phi3ForCausalLM).

Quirks: q, k and v come from one `self_attn.qkv_proj` ([q | k | v] rows) and gate and up from
one `mlp.gate_up_proj` ([gate | up]); both stay fused (a quantized checkpoint stores them
fused too). Partial rotary (`partial_rotary_factor`, Phi-4-mini's 0.75). Long-context
variants use longrope (`short_factor`/`long_factor`); configs written by older transformers
call it "su" or "yarn", and keep `original_max_position_embeddings` at the top level. Kestrel
chooses the factor set for the engine's context (see engine/rope.py). `sliding_window`
(2047 in Phi-3-mini-4k) applies to every layer.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from engine.architectures.base import CausalLM
from engine.config import ModelConfig, RopeParameters
from engine.modules import Attention, AttentionSpec, DecoderLayer, FusedGatedMLP


class Phi3ForCausalLM(CausalLM):
    architectures = ("Phi3ForCausalLM",)

    def build_layers(self, config: ModelConfig) -> list[nn.Module]:
        spec = AttentionSpec(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            sliding_window=config.sliding_window,
            fused_qkv=True,
        )
        return [
            DecoderLayer(
                Attention(spec, i),
                FusedGatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act),
                config.hidden_size,
                config.rms_norm_eps,
            )
            for i in range(config.num_hidden_layers)
        ]

    def layer_rope(self, layer_idx: int) -> RopeParameters:
        rope = self.config.rope
        if rope.rope_type not in ("su", "yarn", "longrope"):
            return rope
        original = rope.original_max_position_embeddings or self.config.extra.get(
            "original_max_position_embeddings"
        )
        return replace(rope, rope_type="longrope", original_max_position_embeddings=original)
