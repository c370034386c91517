"""Temperature, dynamic temperature and quadratic sampling (TGW's smoothing factor/curve).

All three keep -inf logits at -inf and work row by row: a batch of jobs never shares an
entropy or a maximum (TGW computes them over the whole batch, but runs one row at a time).
"""

from __future__ import annotations

import torch
from torch import Tensor


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    return logits / temperature


def apply_dynamic_temperature(logits: Tensor, low: float, high: float, exponent: float) -> Tensor:
    """Divides each row by low + (high - low) * (H / H_max) ** exponent.

    H is the row's entropy (nats), H_max = log(number of tokens with a finite logit), the
    entropy of a uniform choice among them. As in TGW, H is floored at 1e-10 and H_max
    replaced by 1e-10 when at most one token is left (so such a row gets `high`, which
    cannot change a one-token distribution).
    """
    logp = logits.log_softmax(dim=-1)
    p = logp.exp()
    # p log p is 0 for p = 0 (masked tokens give 0 * -inf = nan otherwise).
    entropy = (-torch.where(p > 0, p * logp, 0.0).sum(dim=-1)).clamp_min(1e-10)
    valid = torch.isfinite(logits).sum(dim=-1).to(logits.dtype)
    max_entropy = valid.log()
    max_entropy = torch.where(max_entropy > 0, max_entropy, 1e-10)
    temperature = low + (high - low) * (entropy / max_entropy).pow(exponent)
    return logits / temperature[:, None]


def apply_quadratic_sampling(logits: Tensor, factor: float, curve: float) -> Tensor:
    """Quadratic (and with curve > 1, cubic) smoothing around the top logit m:

    x -> m - k * factor * (x - m)**2 + s * factor * (x - m)**3, k = (3 - curve) / 2,
    s = (curve - 1) / 2. The top token keeps its logit; the others fall off faster the
    larger the factor. -inf stays -inf.
    """
    top = logits.amax(dim=-1, keepdim=True)
    diff = logits - top
    k = (3.0 - curve) / 2.0
    s = (curve - 1.0) / 2.0
    smoothed = top - k * factor * diff.square() + s * factor * diff.pow(3)
    return torch.where(torch.isneginf(logits), logits, smoothed)
