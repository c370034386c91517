"""Penalties that look at the context: repetition/presence/frequency, DRY, no_repeat_ngram.

Context ids are [B, L] int64, rows left-padded with -1 so that the last column is every
row's newest token. Ids outside [0, V) are ignored everywhere: a tokenizer may know more
tokens than the lm_head produces, and padding is negative.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# TGW stops extending a DRY match at 50 tokens: the penalty would overflow long before
# that, and it bounds the work.
DRY_MAX_MATCH = 50


def token_counts(context_ids: Tensor, vocab_size: int, last_n: int = 0) -> Tensor:
    """How often each token occurs in each row's last `last_n` ids (all when 0).

    context_ids: [B, L] int64, left-padded with -1. Returns [B, V] float32.
    """
    ids = context_ids[:, -last_n:] if last_n > 0 else context_ids
    # Everything out of range goes to an extra column that is cut off afterwards.
    ids = torch.where((ids < 0) | (ids >= vocab_size), vocab_size, ids)
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_repetition_penalty(logits: Tensor, counts: Tensor, penalty: float) -> Tensor:
    """HF's RepetitionPenaltyLogitsProcessor: applied once per token present, whatever
    its count."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(counts > 0, penalized, logits)


def apply_presence_penalty(logits: Tensor, counts: Tensor, presence: float) -> Tensor:
    """OpenAI's presence penalty: `presence` off every token present in the range."""
    return logits - presence * (counts > 0).to(logits.dtype)


def apply_frequency_penalty(logits: Tensor, counts: Tensor, frequency: float) -> Tensor:
    """OpenAI's frequency penalty: `frequency` off per occurrence in the range."""
    return logits - frequency * counts


def apply_presence_frequency_penalty(
    logits: Tensor, counts: Tensor, presence: float, frequency: float
) -> Tensor:
    """Both OpenAI penalties in one step: logit -= presence * (count > 0) + frequency * count."""
    return logits - (presence * (counts > 0).to(logits.dtype) + frequency * counts)


def apply_dry(
    logits: Tensor,
    context_ids: Tensor,
    multiplier: float,
    base: float,
    allowed_length: int,
    breaker_ids: Tensor,
) -> Tensor:
    """DRY ("don't repeat yourself"), with TGW's semantics.

    For every earlier occurrence of the context's last token, the match length is how far
    the text before it equals the text before the end (at most 50 tokens, never across a
    sequence breaker, never past the start). The token that followed that occurrence
    would continue the repeat: its logit loses multiplier * base ** (length - allowed_length)
    for its longest match, when that length reaches allowed_length. Nothing happens when
    the last token is a breaker, and a breaker is never penalized.

    All positions are matched at once ([B, L, 50] comparisons), so there is no Python loop
    over the context and no host sync. `context_ids` is the look-back range already.
    """
    batch, length = context_ids.shape
    vocab = logits.shape[-1]
    if length < 2:
        return logits
    k = min(DRY_MAX_MATCH, length - 1)  # a candidate sits at <= L-2, so at most L-1 match
    # A handful of breakers: a broadcast compare beats torch.isin's general paths.
    is_breaker = (context_ids[..., None] == breaker_ids).any(-1)
    # The end of the text, newest first; a breaker or padding there ends every match.
    tail = context_ids[:, length - k :].flip(-1)
    tail_ok = (tail >= 0) & ~is_breaker[:, length - k :].flip(-1)
    # For each candidate position i < L-1, the k tokens ending at i, newest first; before
    # the start of the text the padding value -1 matches nothing.
    padded = F.pad(context_ids[:, :-1], (k - 1, 0), value=-1)
    windows = padded.unfold(1, k, 1).flip(-1)  # [B, L-1, k]
    equal = (windows == tail[:, None, :]) & (windows >= 0) & tail_ok[:, None, :]
    match = equal.to(torch.int32).cumprod(-1).sum(-1)  # leading run of matches, [B, L-1]

    following = context_ids[:, 1:]
    valid = (match > 0) & ~is_breaker[:, 1:] & (following >= 0) & (following < vocab)
    # Tokens that follow no match go to a spare column, cut off afterwards.
    target = torch.where(valid, following, vocab)
    longest = torch.zeros(batch, vocab + 1, dtype=match.dtype, device=logits.device)
    longest.scatter_reduce_(1, target, torch.where(valid, match, 0), reduce="amax")
    longest = longest[:, :vocab]
    exponent = (longest - allowed_length).to(logits.dtype)
    penalty = multiplier * torch.pow(base, exponent)
    return logits - torch.where(longest >= allowed_length, penalty, 0.0)


def apply_no_repeat_ngram(logits: Tensor, context_ids: Tensor, ngram_size: int) -> Tensor:
    """Bans every token that would complete an n-gram already in the context (HF's
    NoRepeatNGramLogitsProcessor): the last n-1 tokens are matched against every window."""
    length = context_ids.shape[1]
    vocab = logits.shape[-1]
    if length < ngram_size:
        return logits
    prefix = context_ids[:, length - ngram_size + 1 :]  # the last n-1 tokens, [B, n-1]
    windows = context_ids.unfold(1, ngram_size, 1)  # [B, L-n+1, n]
    match = (windows[..., :-1] == prefix[:, None, :]).all(-1)
    # Padding never forms an n-gram: a row shorter than n has nothing to ban.
    match &= (windows >= 0).all(-1) & (prefix >= 0).all(-1, keepdim=True)
    banned_ids = torch.where(match & (windows[..., -1] < vocab), windows[..., -1], vocab)
    banned = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    banned.scatter_(1, banned_ids, True)
    return logits.masked_fill(banned[:, :vocab], float("-inf"))
