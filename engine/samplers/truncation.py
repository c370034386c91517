"""Truncation samplers: each sets the logits of the tokens it drops to -inf.

Every one keeps at least the most likely token, as transformers and TGW do with their
default min_tokens_to_keep of 1. Where transformers has the sampler (top_k, top_p, min_p,
typical_p, epsilon/eta cutoff) the arithmetic follows it so that the masks agree exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_NEG_INF = float("-inf")


def _not_top(logits: Tensor) -> Tensor:
    return logits < logits.amax(dim=-1, keepdim=True)


def apply_top_k(logits: Tensor, top_k: int) -> Tensor:
    """Keeps the k largest logits (and any tied with the k-th), as HF's TopKLogitsWarper."""
    k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: Tensor, top_p: float) -> Tensor:
    """Keeps the smallest set of most likely tokens whose probability reaches top_p.

    Same arithmetic as HF's TopPLogitsWarper (ascending sort, drop tokens whose cumulative
    probability is <= 1 - top_p, always keep the top token), so the masks agree exactly.
    """
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cumulative <= (1 - top_p)
    sorted_remove[..., -1] = False
    remove = sorted_remove.scatter(-1, sorted_idx, sorted_remove)
    return logits.masked_fill(remove, _NEG_INF)


def apply_min_p(logits: Tensor, min_p: float) -> Tensor:
    """Drops tokens less likely than min_p times the top token, as HF's MinPLogitsWarper."""
    probs = logits.softmax(dim=-1)
    # min_p <= 1, so the top token is never below the threshold and always survives.
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(remove, _NEG_INF)


def apply_top_a(logits: Tensor, top_a: float) -> Tensor:
    """Drops tokens with probability below top_a * p_max ** 2."""
    probs = logits.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < top_a * top * top, _NEG_INF)


def apply_typical_p(logits: Tensor, mass: float) -> Tensor:
    """Locally typical sampling (Meister et al.), as HF's TypicalLogitsWarper: tokens are
    ranked by |-log p - H| (H the entropy) and the closest ones kept until their
    probability reaches `mass`."""
    logp = logits.log_softmax(dim=-1)
    p = logp.exp()
    entropy = -(logp * p).nansum(dim=-1, keepdim=True)  # masked tokens: 0 * -inf = nan
    distance = (-logp - entropy).abs()
    sorted_distance, order = torch.sort(distance, dim=-1)
    cumulative = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    # The first token whose cumulative mass reaches `mass` is the last one kept; ties in
    # distance with it are kept too.
    last = (cumulative < mass).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    sorted_remove = sorted_distance > sorted_distance.gather(-1, last)
    sorted_remove[..., 0] = False
    remove = sorted_remove.scatter(-1, order, sorted_remove)
    return logits.masked_fill(remove, _NEG_INF)


def apply_epsilon_cutoff(logits: Tensor, epsilon: float) -> Tensor:
    """Drops tokens with probability below epsilon (a probability, not TGW's 1e-4 units)."""
    remove = (logits.softmax(dim=-1) < epsilon) & _not_top(logits)
    return logits.masked_fill(remove, _NEG_INF)


def apply_eta_cutoff(logits: Tensor, epsilon: float) -> Tensor:
    """Eta sampling (Hewitt et al.): drops tokens with probability below
    min(epsilon, sqrt(epsilon) * exp(-H)), H the entropy in nats."""
    logp = logits.log_softmax(dim=-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(dim=-1, keepdim=True)
    eta = torch.clamp(math.sqrt(epsilon) * torch.exp(-entropy), max=epsilon)
    remove = (p < eta) & _not_top(logits)
    return logits.masked_fill(remove, _NEG_INF)


def apply_tfs(logits: Tensor, z: float) -> Tensor:
    """Tail-free sampling: in probability order, the normalized |second difference| is
    summed and tokens past where the sum exceeds z are dropped. As in TGW (after the
    original), the top token is always kept and the last one always dropped."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    curvature = probs.diff(dim=-1).diff(dim=-1).abs()
    cdf = (curvature / curvature.sum(dim=-1, keepdim=True)).cumsum(dim=-1)
    batch = logits.shape[0]
    keep_first = torch.zeros(batch, 1, dtype=torch.bool, device=logits.device)
    drop_last = torch.ones(batch, 1, dtype=torch.bool, device=logits.device)
    sorted_remove = torch.cat((keep_first, cdf > z, drop_last), dim=-1)
    remove = sorted_remove.scatter(-1, order, sorted_remove)
    return logits.masked_fill(remove, _NEG_INF)


def apply_top_n_sigma(logits: Tensor, n_sigma: float) -> Tensor:
    """Top-nσ (Tang et al.): keeps tokens whose logit is within n standard deviations of
    the top logit.

    The standard deviation (Bessel-corrected, like torch.std) is over the tokens still in
    play: TGW's transformers path counts masked (-inf) tokens as zeros, which only differs
    when something was masked before it (its default order runs it first).
    """
    finite = torch.isfinite(logits)
    count = finite.sum(dim=-1, keepdim=True).to(logits.dtype)
    values = torch.where(finite, logits, 0.0)
    mean = values.sum(dim=-1, keepdim=True) / count
    squares = torch.where(finite, (logits - mean).square(), 0.0).sum(dim=-1, keepdim=True)
    std = (squares / (count - 1).clamp_min(1)).sqrt()
    threshold = logits.amax(dim=-1, keepdim=True) - n_sigma * std
    return logits.masked_fill(logits < threshold, _NEG_INF)
