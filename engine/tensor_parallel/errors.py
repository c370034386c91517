"""The errors of tensor parallelism (kept apart so every module can raise them)."""

from __future__ import annotations


class TensorParallelError(ValueError):
    """The model cannot be sharded over this many ranks (or this way)."""


class RankFailedError(RuntimeError):
    """A tensor-parallel rank failed or stopped answering during a step; the message says
    what is known of it (its error, its exit code)."""
