"""This process's place in a torchrun launch, for the front ends (which do not import the
engine): engine/tensor_parallel/launched.py reads it from torchrun's environment."""

from __future__ import annotations

from engine.tensor_parallel.launched import LaunchedRank, launched_rank

__all__ = ["LaunchedRank", "launched_rank"]
