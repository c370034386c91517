"""What every linear of a model slot has, whatever fills it.

A slot (`q_proj`, `lm_head`, ...) holds an `engine.modules.Linear`, a `QuantizedLinear`, or
a wrapper of one (LoRA's, tensor parallelism's): each has `in_features`, `out_features`
and `forward(x, lora)`. Kept apart from engine/modules.py so that the wrappers' modules
can import it without importing the model's building blocks.
"""

from __future__ import annotations

from torch import nn


def linear_features(linear: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of whatever linear fills a model's slot: `Linear`,
    `QuantizedLinear`, or a wrapper of one (LoRA's, tensor parallelism's)."""
    features = (getattr(linear, "in_features", None), getattr(linear, "out_features", None))
    if not (isinstance(features[0], int) and isinstance(features[1], int)):
        raise TypeError(f"{type(linear).__name__} is not a linear (no in/out_features)")
    return features[0], features[1]
