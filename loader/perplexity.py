"""Perplexity over fixed-length windows of a text, measured one way for every loader and
every LoRA selection (tools/perplexity.py, tools/lora_compare.py and the web UI's LoRA lab).

The text from character `start_fraction·len` to the end is tokenized once (no BOS), cut into
consecutive non-overlapping windows of `window` tokens (a short tail is dropped) and the
first `windows` of them (all when not given) are scored. Each window goes through
`LoadedModel.token_nll(ids, loras=...)` (the logits of LoadedModel.logits, scored where the
loader computes them), with a BOS token in front when `add_bos`, and every token after the
window's first (every token, with BOS) is predicted from the tokens before it in the window.
Perplexity = exp(Σ NLL / number of predictions).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from loader.base import LoadedModel


def text_windows(
    model: LoadedModel,
    text: str,
    *,
    window: int,
    windows: int | None = None,
    start_fraction: float = 0.0,
) -> list[list[int]]:
    """The token windows of `text` (see the module's contract); ValueError says what is
    wrong with the numbers or that the text is too short."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if not 0.0 <= start_fraction < 1.0:
        raise ValueError(f"start fraction must lie in [0, 1), got {start_fraction}")
    ids = model.encode(text[int(len(text) * start_fraction) :], add_bos=False)
    count = len(ids) // window
    if windows is not None:
        if windows <= 0:
            raise ValueError(f"windows must be positive, got {windows}")
        if windows > count:
            raise ValueError(f"the text has {count} windows of {window} tokens, not {windows}")
        count = windows
    if count == 0:
        raise ValueError(f"the text has fewer than {window} tokens ({len(ids)})")
    return [ids[i * window : (i + 1) * window] for i in range(count)]


@dataclass
class NllSum:
    """Negative log-likelihood summed over `predictions` predicted tokens."""

    nll: float = 0.0
    predictions: int = 0

    def add(self, other: NllSum) -> None:
        self.nll += other.nll
        self.predictions += other.predictions

    @property
    def perplexity(self) -> float:
        if not self.predictions:
            raise ValueError("no tokens were scored")
        return math.exp(self.nll / self.predictions)


def bos_id(model: LoadedModel, add_bos: bool) -> int | None:
    """The BOS token to put in front of windows, None without; a clear error when the
    tokenizer has none but one is asked for."""
    if not add_bos:
        return None
    bos = model.backend.tokenizer.bos_token_id
    if bos is None:
        raise ValueError("the tokenizer has no BOS token; score without BOS (--no-bos)")
    return bos


def window_nll(
    model: LoadedModel,
    window: list[int],
    *,
    bos: int | None,
    loras: Mapping[str, float] | None = None,
) -> NllSum:
    """The NLL of one window under the LoRA selection `loras` (None: the model's own)."""
    ids = ([bos] if bos is not None else []) + list(window)
    # LoadedModel.token_nll: the Kestrel loader scores on the model's device, where the
    # logits are, rather than copying them to the host (200 MB of float32 per 1024-token
    # window of a 49k vocabulary) for a host cross-entropy; the others score logits().
    nll, count = model.token_nll(ids) if loras is None else model.token_nll(ids, loras=loras)
    return NllSum(nll, count)
