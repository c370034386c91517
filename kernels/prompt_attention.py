"""Causal attention of a fresh prompt over its own keys, through torch's fused SDPA.

Contract: q [T, Hq, D], k and v [T, Hk, D] (Hq a multiple of Hk), the same dtype; query i
sees keys 0..i; scores q.k * scale. Returns [T, Hq, D] in q's dtype, contiguous.

Why not the paged prefill kernel: a prompt that starts a sequence (nothing cached before
it) needs no page table, and on Hopper cuDNN's fused attention runs this case about twice
as fast as kernels.paged_attention_prefill (8B shapes on an H100: 0.086 against 0.156 ms
per layer at 2048 tokens, 0.91 against 1.75 ms at 8192). The engine routes only such
prompts here (`ForwardBatch.fresh`), with an unquantized cache and no sliding window or
soft cap cutting in; later chunks, mixed batches and decode stay on the paged kernels.
On the CPU SDPA runs its math path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN first (fastest on Hopper), flash attention next; the math path is the fallback
# (CPU, or shapes neither fused kernel takes).
_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def prompt_attention_applies(
    num_tokens: int,
    head_dim: int,
    *,
    quantized_cache: bool,
    sliding_window: int | None,
    softcap: float | None,
) -> bool:
    """Whether a fresh prompt of `num_tokens` can take `prompt_attention`: its result is
    what the paged kernels would compute from the cache (unquantized K/V, no soft cap, a
    window, if any, that reaches back past the prompt's start)."""
    return (
        num_tokens > 1
        and not quantized_cache
        and softcap is None
        and (sliding_window is None or sliding_window >= num_tokens)
        and head_dim % 8 == 0
        and head_dim <= 256
    )


def prompt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """Causal attention of T new tokens that are a sequence's whole context (see module)."""
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"expected q [T, Hq, D] and k, v [T, Hk, D], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    # [1, H, T, D] views of the token-major tensors (no copies).
    heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    with sdpa_kernel(_BACKENDS):
        out = F.scaled_dot_product_attention(
            *heads_first, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    # The fused kernels return token-major memory, so this is usually no copy.
    return out[0].transpose(0, 1).contiguous()
