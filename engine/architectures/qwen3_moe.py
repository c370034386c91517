"""Qwen3 mixture-of-experts models (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B).

Quirks: Qwen3's attention (q_norm/k_norm); the feed-forward `mlp` is a SparseMoE (router
`mlp.gate`, experts `mlp.experts.<e>.gate_proj/up_proj/down_proj`, no shared expert) on
every `decoder_sparse_step`-th layer not listed in `mlp_only_layers`, a dense GatedMLP of
`intermediate_size` elsewhere. Top-k weights are renormalized only when `norm_topk_prob`
(true in the released models; transformers' default is false) and are cast to the
activation dtype before they scale the experts. The expert count is `num_experts` on the
Hub and `num_local_experts` in configs transformers 5 writes. `sliding_window` applies to
every layer when `use_sliding_window` is true.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from engine.architectures.base import CausalLM, extra_int
from engine.architectures.qwen3 import qwen3_attention_spec
from engine.config import ModelConfig
from engine.modules import DecoderLayer
from engine.moe import QWEN_EXPERT_NAMES, SparseMoE, has_fused_experts


class Qwen3MoeForCausalLM(CausalLM):
    architectures = ("Qwen3MoeForCausalLM",)

    def build_layers(self, config: ModelConfig) -> list[nn.Module]:
        extra = config.extra
        num_experts = extra_int(config, "num_experts", "num_local_experts")
        top_k = extra_int(config, "num_experts_per_tok")
        moe_intermediate = extra_int(config, "moe_intermediate_size")
        sparse_step = extra_int(config, "decoder_sparse_step", default=1)
        mlp_only = set(extra.get("mlp_only_layers") or [])
        window = config.sliding_window if extra.get("use_sliding_window", False) else None
        spec = replace(qwen3_attention_spec(config), sliding_window=window)
        fused = has_fused_experts(self.tensor_names)

        def mlp(i: int) -> nn.Module:
            if i in mlp_only or (i + 1) % sparse_step:
                return self.gated_mlp(
                    i, config.hidden_size, config.intermediate_size, config.hidden_act
                )
            return SparseMoE(
                config.hidden_size,
                moe_intermediate,
                num_experts,
                top_k,
                config.hidden_act,
                norm_topk_prob=bool(extra.get("norm_topk_prob", False)),
                expert_names=QWEN_EXPERT_NAMES,
                fused=fused,
                weights_in_activation_dtype=True,
            )

        return [
            DecoderLayer(self.attention(spec, i), mlp(i), config.hidden_size, config.rms_norm_eps)
            for i in range(config.num_hidden_layers)
        ]
