"""Per-token biases and bans: logit_bias, custom_token_bans, ban_eos_token, min_new_tokens.

The Sampler builds the dense [V] vectors once per vocabulary size (`bias_vector`,
`ban_mask`), so each step is one elementwise op on the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor


def bias_vector(
    logit_bias: Mapping[int, float], vocab_size: int, device: torch.device | str
) -> Tensor:
    """logit_bias as a dense [V] float32 vector; ids beyond the lm_head are dropped (such a
    token cannot be sampled anyway)."""
    vec = torch.zeros(vocab_size, dtype=torch.float32)
    for token, bias in logit_bias.items():
        if token < vocab_size:
            vec[token] = bias
    return vec.to(device)


def ban_mask(token_ids: Iterable[int], vocab_size: int, device: torch.device | str) -> Tensor:
    """A [V] bool mask of the given ids that exist in the vocabulary."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    ids = [i for i in token_ids if 0 <= i < vocab_size]
    if ids:
        mask[ids] = True
    return mask.to(device)


def apply_logit_bias(logits: Tensor, bias: Tensor) -> Tensor:
    """OpenAI's logit_bias: bias [V] added to every row."""
    return logits + bias


def apply_ban(logits: Tensor, mask: Tensor) -> Tensor:
    """Tokens of mask ([V] or [B, V]) set to -inf, as HF's SuppressTokensLogitsProcessor."""
    return logits.masked_fill(mask, float("-inf"))


def min_new_tokens_mask(eos_mask: Tensor, generated: Tensor, min_new_tokens: int) -> Tensor:
    """[B, V] mask of the EOS ids for the rows that have generated fewer than
    min_new_tokens tokens (generated: [B] int on the device; no host sync)."""
    return eos_mask[None, :] & (generated < min_new_tokens)[:, None]
