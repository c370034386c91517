"""Speculative decoding: cheap drafts of the next k tokens, verified by the target model in
one forward of k + 1 query tokens, with the exact acceptance rule.

Drafters (one per job, made by `make_drafter`):
- `NgramDrafter` (prompt lookup): finds the most recent earlier occurrence of the last n
  tokens of the context (n from `max_n` down to `min_n`) and proposes what followed it.
- `DraftModel` (engine/draft_model.py, shared by the jobs, run by the model runner): a
  second, smaller model with the same vocabulary and its own KV cache; each job has a
  `Sequence` in it. Drafts are its greedy tokens.
Both propose deterministic tokens: the draft distribution q is a point mass.

Verification (`accept`): the target's distribution p_j at each of the k + 1 positions is
the job's own sampler chain over the target's logits (penalties see the drafts before
that position). Draft j is accepted with probability min(1, p_j(d) / q_j(d)); at the first
rejection the token is drawn from norm(max(0, p_j - q_j)), and when all k are accepted a
bonus token is drawn from p_k. That is the standard rule (Leviathan et al., Chen et al.):
the output is distributed exactly as the target's own sampling. Greedy settings accept
while the draft equals the argmax, so greedy output is identical with and without
speculation. Samplers with state or coins of their own (mirostat, XTC) do not speculate.

The caller rewinds the KV entries of rejected drafts (engine/rewind.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.generator import JobSampler, apply_position_bans
from engine.samplers.batched import host_to_device

if TYPE_CHECKING:
    from engine.sampling import Sampler

SPECULATIVE_MODES = ("ngram", "draft")
NO_SPECULATION = frozenset({"mirostat", "xtc"})


def can_speculate(sampler: Sampler) -> bool:
    """Whether a job with this sampler may verify drafts (no per-draw state or coin)."""
    return not NO_SPECULATION.intersection(sampler.steps)


class NgramDrafter:
    """Prompt-lookup drafts for one job; keeps an index of its n-grams' last positions."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> end position of its last use
        self._upto = 0  # n-grams ending before this position are indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the context's end."""
        if k <= 0 or len(tokens) < 2:
            return []
        # Index every n-gram that ends before the last token (an occurrence needs a follower).
        for end in range(self._upto, len(tokens) - 1):
            for n in range(self.min_n, self.max_n + 1):
                if end + 1 >= n:
                    self._index[tuple(tokens[end + 1 - n : end + 1])] = end
        self._upto = max(self._upto, len(tokens) - 1)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            key = tuple(tokens[-n:])
            found = self._index.get(key)
            if found is None:
                continue
            if found >= len(tokens) - 1 or tuple(tokens[found + 1 - n : found + 1]) != key:
                self._rebuild(tokens)  # stale after a rewind: index again from scratch
                return self.propose(tokens, k)
            return tokens[found + 1 : found + 1 + k]
        return []

    def rewind(self, length: int) -> None:
        """The context was cut to `length` tokens; entries past it are checked on use."""
        self._upto = min(self._upto, max(0, length - 1))

    def _rebuild(self, tokens: list[int]) -> None:
        self._index.clear()
        self._upto = 0
        for end in range(len(tokens) - 1):
            for n in range(self.min_n, self.max_n + 1):
                if end + 1 >= n:
                    self._index[tuple(tokens[end + 1 - n : end + 1])] = end
        self._upto = len(tokens) - 1


def accept(
    probs: Tensor, drafts: Tensor, generator: torch.Generator, draft_probs: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The speculative sampling rule for one job, on the device without a host sync.

    probs [k+1, V]: the target's distribution at each position; drafts [k]; draft_probs
    [k, V]: the distributions the drafts were drawn from (None: point masses, as both
    drafters here propose). Returns (accepted [] int64: how many drafts stand, token []:
    the token drawn after them, from the residual at the first rejection or from
    probs[k] when all stand)."""
    k = drafts.shape[0]
    index = torch.arange(k, device=probs.device)
    p_draft = probs[index, drafts]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = probs[:k].clone()
        residual[index, drafts] = 0.0
    else:
        q_draft = draft_probs[index, drafts]
        residual = (probs[:k] - draft_probs).clamp_min(0.0)
    uniform = torch.rand(k, generator=generator, device=probs.device)
    ok = uniform * q_draft < p_draft  # u < p/q, without dividing by a zero q
    accepted = ok.to(torch.int64).cumprod(0).sum()
    pool = torch.cat([residual, probs[k:]], dim=0)
    noise = torch.empty_like(pool).exponential_(1.0, generator=generator)
    candidates = (pool / noise).argmax(dim=-1)
    return accepted, candidates[accepted]


def greedy_accept(best: Tensor, drafts: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy verification: best [k+1] are the target's argmax tokens; drafts stand while
    they equal them, and the next token is the target's own at the first difference."""
    k = drafts.shape[0]
    accepted = (best[:k] == drafts).to(torch.int64).cumprod(0).sum()
    return accepted, best[accepted]


def verify(
    sampling: JobSampler, logits: Tensor, drafts: list[int], bans: list[list[int]]
) -> tuple[Tensor, Tensor]:
    """Verify one job's drafts: logits [k+1, V] are the target's at the draft positions
    (after the context's last token and after each draft), `bans[j]` the tokens banned at
    position j. Returns (accepted, next token) as device scalars; no host sync, no state
    changed (the caller advances the sampler by what stands)."""
    device = logits.device
    k = len(drafts)
    draft_ids = host_to_device(torch.tensor(drafts, dtype=torch.int64), device)
    if any(bans):
        logits = apply_position_bans(logits, bans)
    sampler = sampling.sampler
    if sampling.plain_greedy:
        return greedy_accept(logits.argmax(dim=-1), draft_ids)
    # Row j sees the context plus drafts[:j], left-padded with -1 (the Sampler's layout).
    context = torch.cat([sampling.context()[0], draft_ids])
    width = context.shape[0]
    shift = (k - torch.arange(k + 1, device=device))[:, None]
    pos = torch.arange(width, device=device)[None, :] - shift
    rows = torch.where(pos >= 0, context[pos.clamp_min(0)], -1)
    count = torch.arange(k + 1, device=device) + sampler.generated
    scores, allowed = sampler.distribution(logits, rows, generated_count=count)
    empty = torch.isneginf(scores).all(dim=-1)
    fallback = allowed.argmax(dim=-1)
    if sampler.greedy:
        best = torch.where(empty, fallback, scores.argmax(dim=-1))
        return greedy_accept(best, draft_ids)
    probs = scores.softmax(dim=-1)
    # A row the steps emptied takes its fallback token for sure, as sample_with_scores does.
    one_hot = torch.nn.functional.one_hot(fallback, probs.shape[-1]).to(probs.dtype)
    probs = torch.where(empty[:, None], one_hot, probs)
    return accept(probs, draft_ids, sampler.generator)
