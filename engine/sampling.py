"""Token sampling: one `Sampler` per job, built from its `SamplingSettings`.

Contract:
- `Sampler(settings, device=..., eos_token_ids=...)` takes the settings in any form
  `SamplingSettings.from_any` accepts. `sampler.seed` is the seed in use: the one asked
  for, or for seed -1 one drawn once from os.urandom, so that a run can be reported and
  repeated. Each sampler owns a `torch.Generator` on its device: draws depend only on the
  seed and the calls made to this sampler, never on global RNG state.
- `sample(logits[V], context_ids[L]) -> int` and `sample_batch(logits[B, V],
  context_ids[B, L]) -> Tensor[B]`. Logits must be on the sampler's device. `context_ids`
  are the tokens the penalties look at (prompt and generated so far, as TGW does); in a
  batch, rows are left-padded with -1 so the last column is every row's newest token.
- Order (TGW's default sampler_priority, HF semantics for each step):
    1. repetition_penalty over the unique tokens of the last `repetition_penalty_range`
       context tokens (all when 0): positive logits divided, negative multiplied;
    2. presence/frequency penalties over the same tokens (OpenAI semantics):
       logit -= presence * (count > 0) + frequency * count;
    3. EOS ban (`ban_eos_token`): the eos ids set to -inf;
    4. temperature, top_k, top_p, min_p; with `temperature_last`, temperature moves after
       min_p, as in TGW;
    5. a draw from softmax of what is left (-inf entries have probability 0).
  Greedy settings (do_sample False or temperature 0) take the argmax after step 3.
- `process(...)` returns the logits after steps 1-4: their softmax is the distribution
  drawn from (useful for logprobs). The step functions (`apply_*`) are public, work on
  [B, V] logits and never modify their input.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from engine.sampling_settings import SamplingSettings, SamplingSettingsError, sampler_order

__all__ = [
    "Sampler",
    "SamplingSettings",
    "SamplingSettingsError",
    "apply_min_p",
    "apply_presence_frequency_penalty",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "sampler_order",
    "token_counts",
]


def token_counts(context_ids: Tensor, vocab_size: int, last_n: int = 0) -> Tensor:
    """How often each token occurs in each row's last `last_n` ids (all when 0).

    context_ids: [B, L] int64, left-padded with -1. Returns [B, V] float32. Ids outside
    [0, V) are ignored: a tokenizer may know more tokens than the lm_head produces.
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


def apply_presence_frequency_penalty(
    logits: Tensor, counts: Tensor, presence: float, frequency: float
) -> Tensor:
    return logits - (presence * (counts > 0).to(logits.dtype) + frequency * counts)


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    return logits / temperature


def apply_top_k(logits: Tensor, top_k: int) -> Tensor:
    """Keeps the k largest logits (and any tied with the k-th), as HF's TopKLogitsWarper."""
    k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


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
    return logits.masked_fill(remove, float("-inf"))


def apply_min_p(logits: Tensor, min_p: float) -> Tensor:
    """Drops tokens less likely than min_p times the top token, as HF's MinPLogitsWarper."""
    probs = logits.softmax(dim=-1)
    # min_p <= 1, so the top token is never below the threshold and always survives.
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(remove, float("-inf"))


class Sampler:
    def __init__(
        self,
        settings: SamplingSettings | Mapping[str, Any] | None = None,
        *,
        device: torch.device | str = "cpu",
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.settings = SamplingSettings.from_any(settings)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # torch.device("cuda") != torch.device("cuda:0"): pin it so the device check
            # in sample_batch compares like with like.
            self.device = torch.device("cuda", torch.cuda.current_device())
        if any(int(i) < 0 for i in eos_token_ids):
            raise ValueError(f"eos_token_ids must be >= 0, got {list(eos_token_ids)}")
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        s = self.settings
        # 31 bits as TGW draws them: the seed stays exact when a browser shows it.
        self.seed = s.seed if s.seed >= 0 else int.from_bytes(os.urandom(4), "little") >> 1
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)
        self._eos_by_vocab: dict[int, Tensor] = {}

    @property
    def greedy(self) -> bool:
        return self.settings.greedy

    def process(self, logits: Tensor, context_ids: Tensor | Sequence[int]) -> Tensor:
        """Logits [B, V] (or [V]) after penalties, EOS ban, temperature and filters."""
        one_row = logits.dim() == 1
        logits = logits.unsqueeze(0) if one_row else logits
        if logits.device != self.device:
            raise ValueError(f"logits are on {logits.device}, the sampler on {self.device}")
        logits = logits.float()
        ctx = torch.as_tensor(context_ids, dtype=torch.int64, device=logits.device)
        ctx = ctx.reshape(logits.shape[0], -1 if ctx.numel() else 0)
        s = self.settings
        vocab = logits.shape[-1]

        penalize_rep = s.repetition_penalty != 1.0
        penalize_add = s.presence_penalty != 0.0 or s.frequency_penalty != 0.0
        if (penalize_rep or penalize_add) and ctx.shape[1] > 0:
            counts = token_counts(ctx, vocab, s.repetition_penalty_range)
            if penalize_rep:
                logits = apply_repetition_penalty(logits, counts, s.repetition_penalty)
            if penalize_add:
                logits = apply_presence_frequency_penalty(
                    logits, counts, s.presence_penalty, s.frequency_penalty
                )
        if s.ban_eos_token and self.eos_token_ids:
            logits = logits.index_fill(-1, self._eos_ids(vocab), float("-inf"))

        if not s.greedy:
            if not s.temperature_last:
                logits = apply_temperature(logits, s.temperature)
            if s.top_k > 0:
                logits = apply_top_k(logits, s.top_k)
            if s.top_p < 1.0:
                logits = apply_top_p(logits, s.top_p)
            if s.min_p > 0.0:
                logits = apply_min_p(logits, s.min_p)
            if s.temperature_last:
                logits = apply_temperature(logits, s.temperature)
        return logits.squeeze(0) if one_row else logits

    def sample_batch(self, logits: Tensor, context_ids: Tensor | Sequence[Sequence[int]]) -> Tensor:
        """One token per row: logits [B, V], context_ids [B, L] left-padded with -1.

        Returns int64 [B] on the logits' device, without a host sync.
        """
        scores = self.process(logits, context_ids)
        if self.greedy:
            return scores.argmax(dim=-1)
        probs = scores.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def sample(self, logits: Tensor, context_ids: Tensor | Sequence[int]) -> int:
        """One token from logits [V] given the context [L]."""
        if logits.dim() != 1:
            raise ValueError(f"sample takes logits [V], got {list(logits.shape)}")
        ctx = torch.as_tensor(context_ids, dtype=torch.int64, device=logits.device)
        return int(self.sample_batch(logits.unsqueeze(0), ctx.reshape(1, -1))[0])

    def _eos_ids(self, vocab_size: int) -> Tensor:
        # An eos id beyond the lm_head cannot be sampled anyway, so it needs no ban.
        if vocab_size not in self._eos_by_vocab:
            ids = [i for i in self.eos_token_ids if i < vocab_size]
            self._eos_by_vocab[vocab_size] = torch.tensor(
                ids, dtype=torch.int64, device=self.device
            )
        return self._eos_by_vocab[vocab_size]
