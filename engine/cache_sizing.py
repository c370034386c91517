"""How many tokens the KV cache holds when the caller gives no size.

By default the cache holds one full context (max_seq_len tokens), so a server with 64 users
runs them one context at a time even on a GPU with tens of GB free. With
`cache_memory_fraction` (the API server sets it) the cache on a single GPU takes that
fraction of the memory free before loading, less the weights (their files' size, an upper
bound for 16-bit and quantized checkpoints) and a reserve for activations, logits and the
decode graphs; never less than one context, never more than max_batch contexts (more
would never be used). Elsewhere (the CPU, a split over several GPUs) it does not apply and
the cache stays one context.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

RESERVE_BYTES = 2**30  # CUDA context growth, decode graphs' pools, allocator slack


def weights_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def memory_sized_tokens(
    *,
    fraction: float,
    device: torch.device,
    model_dir: Path,
    token_bytes: int,
    max_seq_len: int,
    max_batch: int,
    prefill_chunk: int,
    vocab_size: int,
    page_size: int,
) -> int | None:
    """Cache tokens from free memory on `device`, or None where sizing does not apply."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(device)
    # Logits of a prefill chunk in float32, twice (sampling copies), and the reserve.
    reserve = RESERVE_BYTES + 2 * 4 * prefill_chunk * vocab_size
    budget = int(free * fraction) - weights_bytes(model_dir) - reserve
    tokens = max(budget, 0) // max(token_bytes, 1)
    tokens = min(max(tokens, max_seq_len), max_batch * max_seq_len)
    return -(-tokens // page_size) * page_size


def describe(tokens: int, token_bytes: int, max_seq_len: int, how: str) -> str:
    """The log line that says what the cache holds."""
    return (
        f"KV cache: {tokens} tokens ({tokens * token_bytes / 2**30:.2f} GiB, {how}): "
        f"{tokens // max_seq_len} job(s) of a full {max_seq_len}-token context at once, "
        "more of shorter ones"
    )
