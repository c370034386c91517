"""Gemma 2 (Gemma2ForCausalLM).

Quirks:
- embeddings are multiplied by sqrt(hidden_size) rounded to the activation dtype first
  (bfloat16 turns sqrt(2304) = 48.0 exactly, sqrt(3072) = 55.43 into 55.5);
- every RMSNorm multiplies by (1 + w) in float32 before casting back (`unit_offset`);
- four norms per layer: input, post_attention (on the attention output, before the
  residual add), pre_feedforward and post_feedforward (the same around the MLP);
- attention scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- attention scores are soft-capped (`attn_logit_softcapping`, 50) and so are the final
  logits (`final_logit_softcapping`, 30): cap * tanh(x / cap);
- sliding-window attention (`sliding_window`, 4096) on alternating layers, layer 0 first,
  unless config.json lists `layer_types`;
- the MLP activation is `hidden_activation` (gelu_pytorch_tanh), which wins over
  `hidden_act`; the LM head is tied to the embeddings.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

import torch
from torch import nn

from engine.architectures.base import CausalLM, layer_types, layer_windows
from engine.build_plan import BuildPlan
from engine.cache import ForwardBatch, PagedKVCache
from engine.config import ModelConfig
from engine.lora.batch import LoraBatch
from engine.modules import Attention, AttentionSpec, RMSNorm, Rotary


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm block: h += post_norm(attn(norm(h))); h += post_ff(mlp(pre_ff(h)))."""

    def __init__(self, attn: Attention, mlp: nn.Module, hidden: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)

    def forward(
        self, h: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache, rotary: Rotary
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), batch, cache, rotary)
        h = h + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(h), batch.lora)
        out: torch.Tensor = h + self.post_feedforward_layernorm(mlp)
        return out

    def forward_residual(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        cache: PagedKVCache,
        rotary: Rotary,
        next_norm: nn.Module | None = None,
        next_qkv: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the residual adds inside the input and pre-feedforward norms (see
        engine.modules.DecoderLayer.forward_residual); the post norms stay separate.
        `next_norm` and `next_qkv` are unused: no norm folds into this layer's GEMVs."""
        if residual is None:
            normed, residual = self.input_layernorm(x), x
        else:
            normed, residual = self.input_layernorm.forward_add(x, residual)
        attn = self.self_attn(normed, batch, cache, rotary)
        normed, residual = self.pre_feedforward_layernorm.forward_add(
            self.post_attention_layernorm(attn), residual
        )
        return self.post_feedforward_layernorm(self.mlp(normed, batch.lora)), residual


def gemma_activation(config: ModelConfig) -> str:
    return str(config.extra.get("hidden_activation") or config.hidden_act)


def gemma_attention_spec(config: ModelConfig) -> AttentionSpec:
    scalar = config.extra.get("query_pre_attn_scalar") or config.head_dim
    return AttentionSpec(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        qkv_bias=config.attention_bias,
        o_bias=config.attention_bias,
        scale=float(scalar) ** -0.5,
        softcap=config.extra.get("attn_logit_softcapping"),
        norm_eps=config.rms_norm_eps,
        norm_unit_offset=True,
    )


def alternating(layer_idx: int) -> str:
    return "sliding_attention" if (layer_idx + 1) % 2 else "full_attention"


class Gemma2ForCausalLM(CausalLM):
    architectures = ("Gemma2ForCausalLM",)
    unit_offset_norm = True
    # Gemma's residual stream grows past float16's 65,504: Gemma-3-270M's reaches 103,792 at
    # <bos> and about 99,000 mid-text in float32, so in float16 every logit is NaN (it
    # was trained in bfloat16).
    overflows_float16 = True

    def __init__(
        self,
        config: ModelConfig,
        *,
        tensor_names: Collection[str] | None = None,
        plan: BuildPlan | None = None,
    ) -> None:
        super().__init__(config, tensor_names=tensor_names, plan=plan)
        self.final_logit_softcap = config.extra.get("final_logit_softcapping")

    def build_layers(self, config: ModelConfig) -> list[nn.Module]:
        spec = gemma_attention_spec(config)
        windows = layer_windows(config, layer_types(config, alternating))
        return [
            GemmaDecoderLayer(
                self.attention(replace(spec, sliding_window=window), i),
                self.gated_mlp(
                    i, config.hidden_size, config.intermediate_size, gemma_activation(config)
                ),
                config.hidden_size,
                config.rms_norm_eps,
            )
            for i, window in enumerate(windows)
        ]

    def embed(self, token_ids: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        # sqrt(hidden) rounded to the weights' dtype, as transformers' normalizer, but as a
        # Python number: a CPU tensor copied to the GPU here could not be graph-captured.
        dtype = self.embed_dtype
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=dtype).item()
        embedded: torch.Tensor = self.model.embed_tokens(token_ids, lora)
        return embedded * scale
