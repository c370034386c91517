"""The one error of tensor parallelism's set-up (kept apart so every module can raise it)."""

from __future__ import annotations


class TensorParallelError(ValueError):
    """The model cannot be sharded over this many ranks (or this way)."""
