"""Mixtral (MixtralForCausalLM: Mixtral-8x7B, 8x22B).

Quirks: the feed-forward is a SparseMoE of `num_local_experts` experts, `num_experts_per_tok`
of them per token, weights renormalized over the chosen ones (a softmax over the top-k
logits) and kept in float32 when they scale the experts. Checkpoint names: the Hub's (and
`save_pretrained`'s default) `block_sparse_moe.gate` + `block_sparse_moe.experts.<e>.w1/w3/w2`
(gate/up/down); transformers 5's fused layout renames the block to `mlp` and stores
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, which loads too. Attention is
Mistral's: `sliding_window` (null in released configs) applies to every layer.
"""

from __future__ import annotations

from torch import nn

from engine.architectures.base import CausalLM, extra_int
from engine.config import ModelConfig
from engine.modules import AttentionSpec, DecoderLayer
from engine.moe import MIXTRAL_EXPERT_NAMES, SparseMoE, has_fused_experts


class MixtralForCausalLM(CausalLM):
    architectures = ("MixtralForCausalLM",)

    def build_layers(self, config: ModelConfig) -> list[nn.Module]:
        spec = AttentionSpec(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            sliding_window=config.sliding_window,
        )
        num_experts = extra_int(config, "num_local_experts")
        top_k = extra_int(config, "num_experts_per_tok")
        fused = has_fused_experts(self.tensor_names)
        return [
            DecoderLayer(
                self.attention(spec, i),
                SparseMoE(
                    config.hidden_size,
                    config.intermediate_size,
                    num_experts,
                    top_k,
                    config.hidden_act,
                    norm_topk_prob=True,
                    expert_names=MIXTRAL_EXPERT_NAMES,
                    fused=fused,
                ),
                config.hidden_size,
                config.rms_norm_eps,
                mlp_name="mlp" if fused else "block_sparse_moe",
            )
            for i in range(config.num_hidden_layers)
        ]
