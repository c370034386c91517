"""The API server's default load options: on a GPU its KV cache takes most of the free
memory (engine/cache_sizing.py), so concurrent users share one large cache instead of
queueing for one context. Only for the kestrel loader, and only when the caller sized the
cache in no way of its own; the engine ignores it on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import loader

CACHE_MEMORY_FRACTION = 0.9
_SIZES = ("cache_tokens", "cache_gib", "cache_memory_fraction")


def with_cache_default(
    options: dict[str, Any], path: Path, loader_name: str | None, fraction: float | None = None
) -> dict[str, Any]:
    """`options` plus cache_memory_fraction where it applies."""
    if any(options.get(key) is not None for key in _SIZES):
        return options
    try:
        chosen = loader_name or loader.detect(path)
    except Exception:  # detection problems are reported by the load itself
        return options
    if chosen != "kestrel":
        return options
    return {**options, "cache_memory_fraction": fraction or CACHE_MEMORY_FRACTION}
