"""Attention over the paged KV cache: the op `paged_attention` (paged.py: contract, torch
reference, dispatcher), which runs the Triton decode kernel (decode.py: flash-decoding,
one new token per sequence) or the prefill kernel (prefill.py: any chunk lengths); both
read the cache through the tiles of tiles.py. `prompt_attention` (prompt.py) is a fresh
prompt's causal attention over its own keys through torch's fused SDPA, which the engine
takes where no cached key comes before the prompt.
"""

from kernels.attention.paged import (
    paged_attention,
    paged_attention_reference,
    paged_attention_triton,
)
from kernels.attention.prompt import prompt_attention, prompt_attention_applies

__all__ = [
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_triton",
    "prompt_attention",
    "prompt_attention_applies",
]
