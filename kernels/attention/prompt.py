"""Causal attention of a fresh prompt over its own keys, through torch's fused SDPA.

Contract: q [T, Hq, D], k and v [T, Hk, D] (Hq a multiple of Hk), the same dtype; query i
sees keys 0..i; scores q.k * scale. Returns [T, Hq, D] in q's dtype, contiguous.

Why not the paged prefill kernel: a prompt that starts a sequence (nothing cached before
it) needs no page table, and torch's fused attention kernels are faster. Each backend on
its own, 8B shapes on an H100, ms per layer at 512 / 2048 / 8192 tokens: cuDNN 0.026 /
0.086 / 0.91, flash attention 0.039 / 0.167 / 1.71, kernels/attention/prefill.py
0.082 / 0.156 / 1.75. Of the backends allowed below, torch picks by its own priority: on
Hopper with torch >= 2.10 and its bundled cuDNN past 9.15 (torch 2.11) that is cuDNN,
which the prompt graphs then capture; older setups get flash attention. The engine routes
only such prompts here (`ForwardBatch.fresh`), with an unquantized cache and no sliding
window or soft cap cutting in; later chunks, mixed batches and decode stay on the paged
kernels. On a GPU only float16/bfloat16 come here (the fused kernels' types; the math
path would build [H, T, T] scores); on the CPU SDPA runs its math path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# The backends torch may pick from, by its own priority (the order here does not set it):
# cuDNN or flash attention on a GPU, the math path on the CPU. This set is what the H100
# runs and tests used.
_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def prompt_attention_applies(
    q: torch.Tensor,
    *,
    quantized_cache: bool,
    sliding_window: int | None,
    softcap: float | None,
) -> bool:
    """Whether a fresh prompt's queries q [T, Hq, D] can take `prompt_attention`: its result
    is what the paged kernels would compute from the cache (unquantized K/V, no soft cap, a
    window, if any, that reaches back past the prompt's start), and on a GPU in a type
    flash attention takes."""
    num_tokens, _, head_dim = q.shape
    on_gpu = q.device.type == "cuda"
    return (
        num_tokens > 1
        and (not on_gpu or q.dtype in (torch.float16, torch.bfloat16))
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
