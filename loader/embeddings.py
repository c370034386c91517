"""Embeddings from a loaded model: its final hidden states, pooled and L2-normalised.

Pooling is "mean" (over the tokens) or "last" (the last token's state, which decoder
embedding models such as Qwen3-Embedding and e5-mistral are trained for). A model
directory that carries a sentence-transformers pooling config (`1_Pooling/config.json`)
names its own; otherwise the default is "mean". A plain chat model gives embeddings too,
but they were never trained for retrieval: use an embedding model for that.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

POOLINGS = ("mean", "last")
POOLING_CONFIG = Path("1_Pooling") / "config.json"
# sentence-transformers' keys for the poolings Kestrel offers.
_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


class EmbeddingError(ValueError):
    """An embedding cannot be made as asked (the message names what is wrong; `param`, the
    argument at fault, when it is one: "pooling", "dimensions" or "input")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_pooling(pooling: str) -> str:
    """`pooling` if Kestrel offers it (EmbeddingError otherwise)."""
    if pooling not in POOLINGS:
        raise EmbeddingError(
            f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}", param="pooling"
        )
    return pooling


def default_pooling(model_dir: Path) -> str:
    """The pooling the model's sentence-transformers config names, else "mean"."""
    path = model_dir / POOLING_CONFIG
    if not path.is_file():
        return "mean"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise EmbeddingError(f"{path} is not readable JSON: {error}") from None
    if not isinstance(config, dict):
        raise EmbeddingError(f"{path} must hold a JSON object")
    named = [pooling for key, pooling in _MODES.items() if config.get(key) is True]
    if len(named) != 1:
        others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v)
        raise EmbeddingError(
            f"{path} must turn on exactly one of {', '.join(_MODES)} (Kestrel's poolings), "
            f"got {', '.join(others) or 'none'}"
        )
    return named[0]


def pool(hidden: torch.Tensor, pooling: str, dimensions: int | None = None) -> torch.Tensor:
    """hidden [tokens, width] -> one L2-normalised vector (float32), pooled by `pooling`
    (check_pooling). `dimensions` keeps that many leading components before normalising
    (Matryoshka-trained models)."""
    if hidden.shape[0] == 0:
        raise EmbeddingError("the input is empty: at least one token is needed", param="input")
    vector = hidden.float().mean(dim=0) if pooling == "mean" else hidden[-1].float()
    if dimensions is not None:
        if not 1 <= dimensions <= vector.numel():
            raise EmbeddingError(
                f"dimensions must be in 1..{vector.numel()} (the model's width), got {dimensions}",
                param="dimensions",
            )
        vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0)
