"""Gemma 3 text models (Gemma3ForCausalLM: gemma-3-270m, gemma-3-1b).

Quirks: Gemma 2's (scaled embeddings, (1 + w) norms, four norms per layer,
query_pre_attn_scalar, gelu_pytorch_tanh) plus
- per-head q/k RMSNorm (`q_norm`, `k_norm`, also (1 + w)) before RoPE;
- no attention soft-capping in the released configs (`attn_logit_softcapping` null, but
  honoured if set), nor final-logit capping;
- five local (sliding-window) layers to one global: `layer_types`, or for older configs
  `sliding_window_pattern` (default 6: layer i is global when (i + 1) % 6 == 0);
- local and global layers rotate with different RoPE: transformers 5 nests
  `rope_parameters` by layer type; older configs give `rope_theta` (+ `rope_scaling`) for
  global layers and `rope_local_base_freq` (unscaled) for local ones. transformers'
  defaults are 1e6 global and 1e4 local.

Gemma3ForConditionalGeneration (the 4b+ multimodal checkpoints, with `language_model`
tensor prefixes) is not served here; EmbeddingGemma (`use_bidirectional_attention`) is
not a causal LM and is refused.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from torch import nn

from engine.architectures.base import extra_int, layer_types, layer_windows
from engine.architectures.gemma2 import (
    Gemma2ForCausalLM,
    GemmaDecoderLayer,
    gemma_activation,
    gemma_attention_spec,
)
from engine.build_plan import BuildPlan
from engine.config import ConfigError, ModelConfig, RopeParameters

GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    architectures = ("Gemma3ForCausalLM",)

    def __init__(
        self,
        config: ModelConfig,
        *,
        tensor_names: Collection[str] | None = None,
        plan: BuildPlan | None = None,
    ) -> None:
        if config.extra.get("use_bidirectional_attention"):
            raise ConfigError(
                f"{config.source}: use_bidirectional_attention is set (EmbeddingGemma): an "
                "encoder, not a causal LM"
            )
        super().__init__(config, tensor_names=tensor_names, plan=plan)
        self._types = layer_types(config, self._default_type)
        self._ropes = {
            "full_attention": self._rope_for("full_attention"),
            "sliding_attention": self._rope_for("sliding_attention"),
        }

    def _default_type(self, layer_idx: int) -> str:
        pattern = extra_int(self.config, "sliding_window_pattern", default=6)
        return "sliding_attention" if (layer_idx + 1) % pattern else "full_attention"

    def build_layers(self, config: ModelConfig) -> list[nn.Module]:
        spec = replace(gemma_attention_spec(config), qk_norm=True)
        windows = layer_windows(config, layer_types(config, self._default_type))
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

    def _rope_for(self, layer_type: str) -> RopeParameters:
        config = self.config
        if layer_type in config.rope_by_layer_type:
            return config.rope_by_layer_type[layer_type]
        # transformers defaults the global base to 1e6, not Kestrel's generic 1e4.
        has_theta = "rope_theta" in config.extra or "rope_theta" in (
            config.extra.get("rope_parameters") or {}
        )
        if layer_type == "full_attention":
            return config.rope if has_theta else replace(config.rope, rope_theta=GLOBAL_THETA)
        local = config.extra.get("rope_local_base_freq", LOCAL_THETA)
        return RopeParameters(
            rope_theta=float(local), partial_rotary_factor=config.rope.partial_rotary_factor
        )

    def layer_rope(self, layer_idx: int) -> RopeParameters:
        return self._ropes[self._types[layer_idx]]
