"""The samplers that draw random numbers or keep state: XTC, mirostat 2, and the draw.

All randomness comes from the caller's `torch.Generator`, on the logits' device, so a
seeded job repeats exactly and nothing waits for the host.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_NEG_INF = float("-inf")
_LN2 = math.log(2.0)


def apply_xtc(logits: Tensor, threshold: float, active: Tensor, protected: Tensor) -> Tensor:
    """Exclude Top Choices: when at least two tokens have probability >= threshold, all of
    them but the least likely one are dropped.

    active: [B] bool, the rows whose coin (probability xtc_probability) came up. A row is
    left alone when the drop would take a protected token (TGW: newline and EOS), so XTC
    never suppresses the end of a line or of the text. Tokens already at probability 0 do
    not count; ties at the least likely probability are all kept (TGW keeps one of them).
    """
    probs = logits.softmax(dim=-1)
    above = (probs >= threshold) & (probs > 0)
    lowest = torch.where(above, probs, math.inf).amin(dim=-1, keepdim=True)
    remove = above & (probs > lowest)
    keep_row = active
    if protected.numel():
        keep_row = keep_row & ~remove.index_select(-1, protected).any(dim=-1)
    return logits.masked_fill(remove & keep_row[:, None], _NEG_INF)


def apply_mirostat_v2(logits: Tensor, mu: Tensor) -> Tensor:
    """Mirostat 2's truncation (Basu et al.): drops tokens whose surprise -log2(p) exceeds
    mu ([B], the per-row state), keeping at least the top token."""
    surprise = -logits.log_softmax(dim=-1) / _LN2
    remove = (surprise > mu[:, None]) & (logits < logits.amax(dim=-1, keepdim=True))
    return logits.masked_fill(remove, _NEG_INF)


def mirostat_v2_update(
    mu: Tensor, scores: Tensor, tokens: Tensor, tau: float, eta: float
) -> Tensor:
    """The new mu after drawing `tokens` [B] from softmax(scores): mu - eta * (s - tau),
    with s the observed surprise (bits) of the token under the truncated distribution."""
    logp = scores.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return mu - eta * (-logp / _LN2 - tau)


def draw(scores: Tensor, generator: torch.Generator) -> Tensor:
    """One token per row from softmax(scores), without a host sync.

    argmax(p / q) with q ~ Exp(1) picks index i with probability p_i (the exponential
    race). It is the very computation torch.multinomial does for one sample, so seeds give
    the same tokens as multinomial did, but without multinomial's validity checks, which
    read two values back to the host on every call. A row without any finite score gives
    NaN here; the caller replaces it.
    """
    probs = scores.softmax(dim=-1)
    q = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / q).argmax(dim=-1)
