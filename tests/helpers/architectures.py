"""Tiny configurations of every architecture Kestrel runs (transformers' class, the config's
special fields): the parity and placement tests build models from them."""

from __future__ import annotations

from typing import Any

import transformers as tf

WINDOW = 24


MOE = dict(num_experts_per_tok=2)


GEMMA = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW)


LONGROPE = dict(
    max_position_embeddings=256,
    original_max_position_embeddings=64,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.5 * i for i in range(8)],
    },
)


GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
}


# name: (config class, overrides, extra loader options)
CASES: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]] = {
    "mixtral": (tf.MixtralConfig, dict(num_local_experts=4, **MOE), {}),
    "mixtral-fused-sliding": (
        tf.MixtralConfig,
        dict(num_local_experts=4, sliding_window=WINDOW, save_original_format=False, **MOE),
        {},
    ),
    "qwen2-tied": (tf.Qwen2Config, dict(tie_word_embeddings=True), {}),
    "qwen2-sliding": (
        tf.Qwen2Config,
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        {},
    ),
    "qwen3": (tf.Qwen3Config, dict(head_dim=32), {}),
    "qwen3-moe": (
        tf.Qwen3MoeConfig,
        dict(
            num_experts=4,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            **MOE,
        ),
        {},
    ),
    "qwen3-moe-fused-unnormalized": (
        tf.Qwen3MoeConfig,
        dict(num_experts=4, moe_intermediate_size=48, save_original_format=False, **MOE),
        {},
    ),
    "phi3-partial-rotary": (tf.Phi3Config, dict(partial_rotary_factor=0.5), {}),
    # The long factors serve the 150-token prompt (past the original 64); the greedy run
    # uses a 64-token context, hence the short ones, as transformers does below 64.
    "phi3-longrope": (tf.Phi3Config, LONGROPE, {"greedy_max_seq_len": 64}),
    "gemma2": (
        tf.Gemma2Config,
        dict(attn_logit_softcapping=5.0, final_logit_softcapping=10.0, **GEMMA),
        {},
    ),
    "gemma3": (
        tf.Gemma3TextConfig,
        dict(sliding_window_pattern=2, rope_parameters=GEMMA3_ROPE, **GEMMA),
        {},
    ),
}
